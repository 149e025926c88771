# The two ways a Tandem target is defined; every module folder's CMakeLists.txt uses them.

# Headers are included by the path they are installed under: "tandem/rpc/rpc.h". In the build tree that path is
# <build>/include/tandem, a link to the source root; installed, it is <prefix>/include/tandem/<module>/.
set(TANDEM_INCLUDE_ROOT ${PROJECT_BINARY_DIR}/include)
file(MAKE_DIRECTORY ${TANDEM_INCLUDE_ROOT})
file(CREATE_LINK ${PROJECT_SOURCE_DIR} ${TANDEM_INCLUDE_ROOT}/tandem SYMBOLIC)

# tandem_library(<module> SOURCES <files...> [PUBLIC <libs...>] [PRIVATE <libs...>])
#   One module folder is one static library, tandem_<module>: C++17, headers included as "tandem/<module>/x.h"
#   (examples' and tests' own files from the source root), position-independent so the libraries can later be linked
#   into a shared one.
function(tandem_library module)
  cmake_parse_arguments(L "" "" "SOURCES;PUBLIC;PRIVATE" ${ARGN})
  add_library(tandem_${module} STATIC ${L_SOURCES})
  target_include_directories(tandem_${module} PUBLIC $<BUILD_INTERFACE:${TANDEM_INCLUDE_ROOT}>
                             $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}> $<INSTALL_INTERFACE:include>)
  target_compile_features(tandem_${module} PUBLIC cxx_std_17)
  target_link_libraries(tandem_${module} PUBLIC ${L_PUBLIC} PRIVATE ${L_PRIVATE})
  # The torch target forces CXX_STANDARD 14 on its consumers' non-interface properties; we are C++17.
  set_target_properties(tandem_${module} PROPERTIES CXX_STANDARD 17 POSITION_INDEPENDENT_CODE ON)
endfunction()

# tandem_executable(<name> SOURCES <files...> LIBS <libs...>): an example, a benchmark or a tool.
function(tandem_executable name)
  cmake_parse_arguments(E "" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${E_SOURCES})
  target_link_libraries(${name} PRIVATE ${E_LIBS})
  set_target_properties(${name} PROPERTIES CXX_STANDARD 17)
endfunction()

# tandem_install(<module>...): installs each library as Tandem::<module> in the package `Tandem` (find_package), with
# its folder's public headers (not detail/) under include/tandem/<module>/. Called once, from the top CMakeLists.txt,
# with the modules a user builds on; tandem_<x> targets that are not listed stay inside the build tree.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)
function(tandem_install)
  foreach(module ${ARGN})
    set_target_properties(tandem_${module} PROPERTIES EXPORT_NAME ${module})
    add_library(Tandem::${module} ALIAS tandem_${module})
    install(TARGETS tandem_${module} EXPORT TandemTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
    if(IS_DIRECTORY ${PROJECT_SOURCE_DIR}/${module})
      file(GLOB headers ${PROJECT_SOURCE_DIR}/${module}/*.h)
      install(FILES ${headers} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/tandem/${module})
    endif()
  endforeach()
  set(dir ${CMAKE_INSTALL_LIBDIR}/cmake/Tandem)
  install(EXPORT TandemTargets NAMESPACE Tandem:: DESTINATION ${dir})
  configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/TandemConfig.cmake.in
                                ${PROJECT_BINARY_DIR}/TandemConfig.cmake INSTALL_DESTINATION ${dir})
  write_basic_package_version_file(${PROJECT_BINARY_DIR}/TandemConfigVersion.cmake COMPATIBILITY SameMinorVersion)
  install(FILES ${PROJECT_BINARY_DIR}/TandemConfig.cmake ${PROJECT_BINARY_DIR}/TandemConfigVersion.cmake
          DESTINATION ${dir})
endfunction()
