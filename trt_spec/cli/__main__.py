"""`python -m trt_spec.cli ...`: the same as `trt-spec ...`."""

import sys

from trt_spec.cli import main

sys.exit(main())
