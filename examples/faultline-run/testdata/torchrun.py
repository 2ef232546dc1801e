"""torch.distributed.run, as Debian's torchrun would run it on Python 3.11.

Debian 12's torch 1.13 fails at start on Python 3.11: Std.from_str("0")
returns None, because iterating a Flag no longer yields its zero member.
This mends that one function and runs torch.distributed.run, the baseline
that the recovery benchmark measures faultline-run against.
"""

import re
import sys

from torch.distributed.elastic.multiprocessing import api


def _from_str(cls, vm):
    def to_std(v):
        return cls(int(v))

    if re.match(api._VALUE_REGEX, vm):
        return to_std(vm)
    if re.match(api._MAPPING_REGEX, vm):
        return {int(i): to_std(v) for i, v in (m.split(":") for m in vm.split(","))}
    raise ValueError(f"{vm} does not match: <{api._VALUE_REGEX}> or <{api._MAPPING_REGEX}>")


api.Std.from_str = classmethod(_from_str)

from torch.distributed.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
