# The two ways a Tandem target is defined; every module folder's CMakeLists.txt uses them.

# tandem_library(<module> SOURCES <files...> [PUBLIC <libs...>] [PRIVATE <libs...>])
#   One module folder is one static library, tandem_<module>: C++17, headers included from the source root
#   ("rpc/rpc.h"), position-independent so the libraries can later be linked into a shared one.
function(tandem_library module)
  cmake_parse_arguments(L "" "" "SOURCES;PUBLIC;PRIVATE" ${ARGN})
  add_library(tandem_${module} STATIC ${L_SOURCES})
  target_include_directories(tandem_${module} PUBLIC ${PROJECT_SOURCE_DIR})
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
