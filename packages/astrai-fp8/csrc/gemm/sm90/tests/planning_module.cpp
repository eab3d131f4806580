// The Hopper planner as a host-only Python module, for the CPU tests (no nvcc, no GPU):
//   c++ -std=c++17 -shared -fPIC $(python -m pybind11 --includes) planning_module.cpp -o _sm90_planning$(python3-config --extension-suffix)
#include "../planning_bind.h"

PYBIND11_MODULE(_sm90_planning, m) { astrai::fp8::sm90::bind_planning(m); }
