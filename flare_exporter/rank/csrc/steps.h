// flare's optimizer step counter (steps.cpp), added to the C++ recorder's module by module.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace flare {

void add_steps(pybind11::module_& module);

}  // namespace flare
