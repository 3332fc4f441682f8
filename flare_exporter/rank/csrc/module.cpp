// flare's C++ recorder: one torch extension module, each part adding its own functions and classes.
#include <pybind11/pybind11.h>

#include "collectives.h"
#include "dispatch_timer.h"
#include "op_shift.h"
#include "steps.h"
#include "text_format.h"

PYBIND11_MODULE(flare_cpp_recorder, m) {
  m.doc() =
      "flare-exporter's C++ recorder: the host dispatch timer, the recording backend, completion stamps, the "
      "step counter, the text format";
  flare::add_dispatch_timer(m);
  flare::add_collectives(m);
  flare::add_op_shift(m);
  flare::add_steps(m);
  flare::add_text_format(m);
}
