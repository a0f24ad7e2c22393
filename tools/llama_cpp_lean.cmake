# Included by llama.cpp's own project() call while llama-cpp-python builds it (the
# Makefile passes -DCMAKE_PROJECT_llama.cpp_INCLUDE=<this file> in CMAKE_ARGS).
#
# llama-cpp-python forces llama.cpp's common library on (a cache variable set with
# FORCE, so -DLLAMA_BUILD_COMMON=OFF on the command line is overwritten), installs it,
# and never loads it: its Python package opens libllama, libggml* and, for multimodal
# chat only, libmtmd. libllama-common is 51 of the 178 compile units of the default
# build, plus cpp-httplib, and among the slowest (the chat, argument, JSON-schema and
# Jinja parsers). A normal variable set here shadows that cache entry inside llama.cpp's
# directory only; option() leaves a normal variable alone (policy CMP0077), so common,
# cpp-httplib and their install rule are skipped.
set(LLAMA_BUILD_COMMON OFF)
