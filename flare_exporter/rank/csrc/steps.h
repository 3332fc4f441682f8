// flare's optimizer step counter (steps.cpp), added to the extension's module by op_timer.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace flare {

void add_steps(pybind11::module_& module);

}  // namespace flare
