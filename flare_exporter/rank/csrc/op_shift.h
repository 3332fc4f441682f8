// Host dispatch's per-op shift (op_shift.cpp), added to the C++ recorder's module by module.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace flare {

void add_op_shift(pybind11::module_& module);

}  // namespace flare
