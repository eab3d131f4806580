# The build every AstrAI kernel plugin shares. Include it BEFORE project():
#
#   cmake_minimum_required(VERSION 3.24...3.31)
#   include(cuda-common/cmake/AstraiPlugin.cmake)
#   project(astrai_elementwise LANGUAGES CXX CUDA)
#   astrai_add_kernel_module(_rotary_emb PACKAGE astrai_elementwise SOURCES csrc/rotary_emb.cu)
#
# astrai_add_kernel_module(NAME PACKAGE <pkg> SOURCES <files...> [MIN_SM <sm>])
#   builds a torch-free pybind11 module <pkg>/<NAME>.<soabi>.so with static cudart,
#   compressed fatbins and `-O3 --use_fast_math --expt-relaxed-constexpr -Xptxas -v`
#   (the register report stays in the build log), installs it into the package and
#   (re)writes <pkg>/build_info.json: CUDA version, SASS and PTX archs of every module.
#
# Archs (ASTRAI_CUDA_ARCHS, as a CMake variable or an environment variable):
#   unset / "auto"   the visible GPU's arch when nvidia-smi reports one, else "all"
#   "all"            CUDA 12.x: 80;86;89;90a   CUDA 13.x: 80;86;89;90a;100a;120
#   "native"         the visible GPU's arch (error without one)
#   a list           e.g. "90a" or "80;90a" (';' ',' or ' ' separated); "XY-real" is
#                    SASS, "XY-virtual" PTX, a bare "XY" SASS
# PTX of the highest SASS arch (without its a/f suffix, so it JITs on newer chips) is
# added unless the list names a -virtual entry or ASTRAI_CUDA_PTX is OFF/0.
# MIN_SM drops archs below a module's minimum (FP8: 89).
# ASTRAI_NO_MMA=ON (CMake or environment) defines ASTRAI_NO_MMA: scalar kernels only.
include_guard(GLOBAL)
cmake_policy(VERSION 3.24...3.31)  # recorded by the functions below, whoever includes this

get_filename_component(ASTRAI_COMMON_DIR "${CMAKE_CURRENT_LIST_DIR}/.." REALPATH)

# Each module sets its own CUDA_ARCHITECTURES (below); no project-wide default is wanted.
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES OFF)
endif()

function(_astrai_env_or_var name default out)
  if(DEFINED ${name} AND NOT "${${name}}" STREQUAL "")
    set(${out} "${${name}}" PARENT_SCOPE)
  elseif(DEFINED ENV{${name}} AND NOT "$ENV{${name}}" STREQUAL "")
    set(${out} "$ENV{${name}}" PARENT_SCOPE)
  else()
    set(${out} "${default}" PARENT_SCOPE)
  endif()
endfunction()

function(_astrai_is_true value out)
  string(TOLOWER "${value}" v)
  if(v MATCHES "^(1|on|yes|true|y)$")
    set(${out} TRUE PARENT_SCOPE)
  else()
    set(${out} FALSE PARENT_SCOPE)
  endif()
endfunction()

# The release arch list of a toolkit version (design: per CUDA major).
function(astrai_default_cuda_archs version out)
  string(REGEX MATCH "^[0-9]+" major "${version}")
  if(major EQUAL 12)
    set(${out} "80;86;89;90a" PARENT_SCOPE)
  elseif(major EQUAL 13)
    set(${out} "80;86;89;90a;100a;120" PARENT_SCOPE)
  else()
    message(FATAL_ERROR "AstrAI has no default arch list for CUDA ${version}; "
                        "set ASTRAI_CUDA_ARCHS (e.g. \"90a\").")
  endif()
endfunction()

# The visible GPU's arch ("90a" on an H100/H200), or "" without one. Not CMake's own
# CUDA_ARCHITECTURES=native: that gives "90", whose SASS lacks wgmma and setmaxnreg.
function(astrai_native_cuda_arch out)
  set(${out} "" PARENT_SCOPE)
  find_program(ASTRAI_NVIDIA_SMI nvidia-smi)
  if(NOT ASTRAI_NVIDIA_SMI)
    return()
  endif()
  execute_process(COMMAND "${ASTRAI_NVIDIA_SMI}" --query-gpu=compute_cap --format=csv,noheader
                  OUTPUT_VARIABLE caps RESULT_VARIABLE rc ERROR_QUIET TIMEOUT 20)
  if(NOT rc EQUAL 0 OR NOT caps MATCHES "^([0-9]+)\\.([0-9]+)")
    return()
  endif()
  set(arch "${CMAKE_MATCH_1}${CMAKE_MATCH_2}")
  if(arch STREQUAL "90" OR arch STREQUAL "100")
    string(APPEND arch "a")  # the arch-specific features (wgmma, tcgen05) need the a-target
  endif()
  set(${out} "${arch}" PARENT_SCOPE)
endfunction()

# Resolve ASTRAI_CUDA_ARCHS for a module: two lists of arch names ("90a"), SASS and PTX.
function(astrai_resolve_cuda_archs min_sm sass_out ptx_out)
  _astrai_env_or_var(ASTRAI_CUDA_ARCHS "auto" spec)
  string(STRIP "${spec}" spec)
  string(TOLOWER "${spec}" spec_lower)
  if(spec_lower STREQUAL "auto" OR spec_lower STREQUAL "native")
    astrai_native_cuda_arch(visible_arch)
    if(visible_arch)
      set(spec "${visible_arch}")
      message(STATUS "AstrAI: building for the visible GPU, sm_${visible_arch} (set ASTRAI_CUDA_ARCHS=all for the release list)")
    elseif(spec_lower STREQUAL "native")
      message(FATAL_ERROR "ASTRAI_CUDA_ARCHS=native, but nvidia-smi reports no GPU")
    else()
      set(spec_lower "all")
    endif()
  endif()
  if(spec_lower STREQUAL "all")
    astrai_default_cuda_archs("${CMAKE_CUDA_COMPILER_VERSION}" spec)
  endif()

  string(REGEX REPLACE "[ ,]+" ";" entries "${spec}")
  set(sass "")
  set(ptx "")
  set(explicit_ptx FALSE)
  foreach(entry IN LISTS entries)
    if(entry STREQUAL "")
      continue()
    endif()
    string(REGEX REPLACE "^(sm_|compute_)" "" entry "${entry}")
    if(NOT entry MATCHES "^([0-9]+)([af]?)(-real|-virtual)?$")
      message(FATAL_ERROR "ASTRAI_CUDA_ARCHS: cannot read '${entry}' (want e.g. 80, 90a, 120-virtual)")
    endif()
    set(num "${CMAKE_MATCH_1}")
    set(arch "${CMAKE_MATCH_1}${CMAKE_MATCH_2}")
    if(num LESS min_sm)
      message(STATUS "AstrAI: skipping sm_${arch} for this module (needs sm_${min_sm}+)")
      continue()
    endif()
    if(CMAKE_MATCH_3 STREQUAL "-virtual")
      list(APPEND ptx "${arch}")
      set(explicit_ptx TRUE)
    else()
      list(APPEND sass "${arch}")
    endif()
  endforeach()

  _astrai_env_or_var(ASTRAI_CUDA_PTX "ON" want_ptx)
  _astrai_is_true("${want_ptx}" want_ptx)
  if(NOT explicit_ptx AND want_ptx AND sass)
    set(highest 0)
    foreach(arch IN LISTS sass)
      string(REGEX MATCH "^[0-9]+" num "${arch}")
      if(num GREATER highest)
        set(highest "${num}")
      endif()
    endforeach()
    list(APPEND ptx "${highest}")
  endif()
  list(REMOVE_DUPLICATES sass)
  list(REMOVE_DUPLICATES ptx)
  if(NOT sass AND NOT ptx)
    message(FATAL_ERROR "ASTRAI_CUDA_ARCHS='${spec}' leaves no arch for a module that needs sm_${min_sm}+")
  endif()
  set(${sass_out} "${sass}" PARENT_SCOPE)
  set(${ptx_out} "${ptx}" PARENT_SCOPE)
endfunction()

# The plugin's version tag (+cu130) must name the toolkit that really compiles it.
function(_astrai_check_version_tag)
  set(full "${SKBUILD_PROJECT_VERSION_FULL}")
  if(full MATCHES "\\+cu([0-9]+)$")
    string(REGEX MATCH "^([0-9]+)\\.([0-9]+)" _ "${CMAKE_CUDA_COMPILER_VERSION}")
    set(tag "${CMAKE_MATCH_1}${CMAKE_MATCH_2}")
    if(NOT full MATCHES "\\+cu${tag}$")
      message(FATAL_ERROR "version ${full} names another toolkit than the compiler "
                          "${CMAKE_CUDA_COMPILER} (CUDA ${CMAKE_CUDA_COMPILER_VERSION})")
    endif()
  endif()
endfunction()

# A JSON array of strings.
function(_astrai_json_list out)
  set(json "[]")
  set(i 0)
  foreach(item IN LISTS ARGN)
    string(JSON json SET "${json}" ${i} "\"${item}\"")
    math(EXPR i "${i} + 1")
  endforeach()
  set(${out} "${json}" PARENT_SCOPE)
endfunction()

# Rewrite <binary dir>/<package>/build_info.json from every module added so far.
function(_astrai_write_build_info package)
  get_property(modules GLOBAL PROPERTY ASTRAI_MODULES_${package})
  set(all_sass "")
  set(all_ptx "")
  set(modules_json "{}")
  foreach(module IN LISTS modules)
    get_property(sass GLOBAL PROPERTY ASTRAI_SASS_${module})
    get_property(ptx GLOBAL PROPERTY ASTRAI_PTX_${module})
    list(APPEND all_sass ${sass})
    list(APPEND all_ptx ${ptx})
    _astrai_json_list(sass_json ${sass})
    _astrai_json_list(ptx_json ${ptx})
    string(JSON modules_json SET "${modules_json}" "${module}" "{}")
    string(JSON modules_json SET "${modules_json}" "${module}" sass_archs "${sass_json}")
    string(JSON modules_json SET "${modules_json}" "${module}" ptx_archs "${ptx_json}")
  endforeach()
  list(REMOVE_DUPLICATES all_sass)
  list(REMOVE_DUPLICATES all_ptx)
  _astrai_json_list(sass_json ${all_sass})
  _astrai_json_list(ptx_json ${all_ptx})
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" cuda "${CMAKE_CUDA_COMPILER_VERSION}")
  _astrai_is_true("${ASTRAI_NO_MMA_EFFECTIVE}" no_mma)
  if(no_mma)
    set(no_mma true)
  else()
    set(no_mma false)
  endif()
  set(version "${SKBUILD_PROJECT_VERSION_FULL}")
  if(version STREQUAL "")
    set(version "${SKBUILD_PROJECT_VERSION}")
  endif()
  set(json "{}")
  foreach(key IN ITEMS version cuda)
    string(JSON json SET "${json}" ${key} "\"${${key}}\"")
  endforeach()
  string(JSON json SET "${json}" nvcc_version "\"${CMAKE_CUDA_COMPILER_VERSION}\"")
  string(JSON json SET "${json}" sass_archs "${sass_json}")
  string(JSON json SET "${json}" ptx_archs "${ptx_json}")
  string(JSON json SET "${json}" no_mma ${no_mma})
  string(JSON json SET "${json}" modules "${modules_json}")
  file(WRITE "${CMAKE_BINARY_DIR}/${package}/build_info.json" "${json}\n")
endfunction()

function(astrai_add_kernel_module name)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "" "PACKAGE;MIN_SM" "SOURCES")
  if(NOT ARG_PACKAGE OR NOT ARG_SOURCES)
    message(FATAL_ERROR "astrai_add_kernel_module(${name}): PACKAGE and SOURCES are required")
  endif()
  if(NOT ARG_MIN_SM)
    set(ARG_MIN_SM 0)
  endif()
  if(NOT CMAKE_CUDA_COMPILER_VERSION)
    message(FATAL_ERROR "astrai_add_kernel_module needs project(... LANGUAGES CXX CUDA) first")
  endif()

  find_package(Python REQUIRED COMPONENTS Interpreter Development.Module)
  find_package(pybind11 CONFIG REQUIRED)
  _astrai_check_version_tag()

  astrai_resolve_cuda_archs(${ARG_MIN_SM} sass ptx)
  set(cuda_archs "")  # CMake's own arch syntax: SASS as "90a-real", PTX as "90-virtual"
  set(sass_names "")
  set(ptx_names "")
  foreach(arch IN LISTS sass)
    list(APPEND cuda_archs "${arch}-real")
    list(APPEND sass_names "sm_${arch}")
  endforeach()
  foreach(arch IN LISTS ptx)
    list(APPEND cuda_archs "${arch}-virtual")
    list(APPEND ptx_names "compute_${arch}")
  endforeach()
  message(STATUS "AstrAI: ${ARG_PACKAGE}.${name} for CUDA ${CMAKE_CUDA_COMPILER_VERSION}: "
                 "SASS ${sass_names}, PTX ${ptx_names}")

  _astrai_env_or_var(ASTRAI_NO_MMA "OFF" no_mma)
  _astrai_is_true("${no_mma}" no_mma)
  set(ASTRAI_NO_MMA_EFFECTIVE ${no_mma} PARENT_SCOPE)
  set(ASTRAI_NO_MMA_EFFECTIVE ${no_mma})

  python_add_library(${name} MODULE WITH_SOABI ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE pybind11::headers)
  target_include_directories(${name} PRIVATE "${ASTRAI_COMMON_DIR}/include"
                                             "${CMAKE_CURRENT_BINARY_DIR}/${name}_config")
  target_compile_features(${name} PRIVATE cxx_std_17 cuda_std_17)
  set_target_properties(${name} PROPERTIES
    CUDA_ARCHITECTURES "${cuda_archs}"
    CUDA_RUNTIME_LIBRARY Static
    CUDA_SEPARABLE_COMPILATION OFF
    CXX_VISIBILITY_PRESET hidden
    CUDA_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  target_compile_options(${name} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-O3 --use_fast_math --expt-relaxed-constexpr -Xptxas=-v -Xfatbin=-compress-all>
    $<$<COMPILE_LANGUAGE:CXX>:-O3>)
  # Kernels that exist only in sm_90a code (wgmma, setmaxnreg) may be launched only when
  # the module holds sm_90a SASS: plain sm_90 SASS or compute_90 PTX carries their trap stubs.
  if("90a" IN_LIST sass)
    target_compile_definitions(${name} PRIVATE ASTRAI_SM90A=1)
  else()
    target_compile_definitions(${name} PRIVATE ASTRAI_SM90A=0)
  endif()
  if(no_mma)
    target_compile_definitions(${name} PRIVATE ASTRAI_NO_MMA=1)
    message(STATUS "AstrAI: ASTRAI_NO_MMA is set: scalar kernels only")
  endif()

  string(REPLACE ";" "," sass_csv "${sass_names}")
  string(REPLACE ";" "," ptx_csv "${ptx_names}")
  file(WRITE "${CMAKE_CURRENT_BINARY_DIR}/${name}_config/astrai_build_config.h"
"// Generated by AstraiPlugin.cmake for ${ARG_PACKAGE}.${name}.
#pragma once
#define ASTRAI_BUILD_SASS \"${sass_csv}\"
#define ASTRAI_BUILD_PTX \"${ptx_csv}\"
#define ASTRAI_BUILD_NVCC \"${CMAKE_CUDA_COMPILER_VERSION}\"
")

  set_property(GLOBAL APPEND PROPERTY ASTRAI_MODULES_${ARG_PACKAGE} ${name})
  set_property(GLOBAL PROPERTY ASTRAI_SASS_${name} ${sass_names})
  set_property(GLOBAL PROPERTY ASTRAI_PTX_${name} ${ptx_names})
  _astrai_write_build_info(${ARG_PACKAGE})

  install(TARGETS ${name} LIBRARY DESTINATION ${ARG_PACKAGE})
  install(FILES "${CMAKE_BINARY_DIR}/${ARG_PACKAGE}/build_info.json" DESTINATION ${ARG_PACKAGE})
endfunction()
