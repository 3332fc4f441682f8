// The text exposition format written in C++ (text_format.cpp), added to the C++ recorder's module by module.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace flare {

void add_text_format(pybind11::module_& module);

}  // namespace flare
