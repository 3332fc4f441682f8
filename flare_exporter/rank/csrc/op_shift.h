// Host dispatch's per-op shift (op_shift.cpp), added to the extension's module by op_timer.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace flare {

void add_op_shift(pybind11::module_& module);

}  // namespace flare
