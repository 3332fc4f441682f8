// flare's collective backend (collectives.cpp), added to the extension's module by op_timer.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace flare {

void add_collectives(pybind11::module_& module);

}  // namespace flare
