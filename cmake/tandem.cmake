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

# Precompiled LibTorch: <ATen/ATen.h> costs about 3 s of every compile that includes it (7 s on a loaded core), and
# most of Tandem's do. With TANDEM_PCH (GCC only; clang's fuzzing build parses it as before) it is compiled once, in
# the object library tandem_pch, and every target that links LibTorch (directly or through a tandem_* library) reuses
# it: GCC loads it in under a second. GCC uses a precompiled header only where the code-generation flags match, so
# every such target is compiled as position-independent code (-fPIC, as the libraries already are) and with -pthread;
# -Winvalid-pch says in the build's output where one is not used. The header is then seen by every file of those
# targets, whether it includes it or not: TANDEM_PCH=OFF builds without it (what each file includes is all it sees).
option(TANDEM_PCH "Precompile <ATen/ATen.h> once for every target that builds on LibTorch (GCC)" ON)

# Sets `out` to TRUE when `target` links torch, itself or through the tandem_* libraries it links.
function(_tandem_links_torch target out)
  get_property(known GLOBAL PROPERTY _TANDEM_TORCH_${target} SET)
  if(NOT known)
    set(result FALSE)
    # What it links itself and what it passes on (an INTERFACE library has only the latter).
    get_target_property(own ${target} LINK_LIBRARIES)
    get_target_property(passed ${target} INTERFACE_LINK_LIBRARIES)
    set(libs)
    foreach(list IN ITEMS own passed)
      if(${list})
        list(APPEND libs ${${list}})
      endif()
    endforeach()
    foreach(lib IN LISTS libs)
      if(lib STREQUAL "torch")
        set(result TRUE)
      elseif(lib MATCHES "^tandem_" AND TARGET ${lib})
        _tandem_links_torch(${lib} sub)
        if(sub)
          set(result TRUE)
        endif()
      endif()
      if(result)
        break()
      endif()
    endforeach()
    set_property(GLOBAL PROPERTY _TANDEM_TORCH_${target} ${result})
  endif()
  get_property(result GLOBAL PROPERTY _TANDEM_TORCH_${target})
  set(${out} ${result} PARENT_SCOPE)
endfunction()

# Appends to `out` the targets defined in `dir` and the directories below it.
function(_tandem_targets_below dir out)
  get_property(here DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  get_property(subdirs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
  foreach(sub IN LISTS subdirs)
    _tandem_targets_below(${sub} below)
    list(APPEND here ${below})
  endforeach()
  set(${out} ${here} PARENT_SCOPE)
endfunction()

# tandem_precompile_torch(): called once, at the end of the top CMakeLists.txt, when every target is defined.
function(tandem_precompile_torch)
  if(NOT TANDEM_PCH OR NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    return()
  endif()
  _tandem_targets_below(${PROJECT_SOURCE_DIR} targets)
  add_library(tandem_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch.cc)
  target_link_libraries(tandem_pch PRIVATE torch)
  set_target_properties(tandem_pch PROPERTIES CXX_STANDARD 17 POSITION_INDEPENDENT_CODE ON)
  target_compile_options(tandem_pch PRIVATE -pthread)
  target_precompile_headers(tandem_pch PRIVATE <ATen/ATen.h>)
  foreach(target IN LISTS targets)
    get_target_property(type ${target} TYPE)
    if(NOT type MATCHES "^(STATIC_LIBRARY|EXECUTABLE)$")
      continue()
    endif()
    _tandem_links_torch(${target} uses)
    if(uses)
      target_precompile_headers(${target} REUSE_FROM tandem_pch)
      # -fPIC rather than POSITION_INDEPENDENT_CODE, which gives executables -fPIE: a different code model to GCC.
      # -pthread (defines _REENTRANT) on all of them: most have it from gRPC and abseil already, and a macro defined
      # on one side only makes GCC ignore the header.
      target_compile_options(${target} PRIVATE -fPIC -pthread -Winvalid-pch)
    endif()
  endforeach()
endfunction()
