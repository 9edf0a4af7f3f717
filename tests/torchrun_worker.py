"""Several `steadydiff` commands in one torchrun launch (used by test_distributed.py): each rank starts Python
and imports torch once for all of them.

    torchrun --standalone --nproc_per_node=2 tests/torchrun_worker.py PLAN.json

PLAN.json is {"out": DIR, "commands": [{"name": NAME, "argv": [...], "dump": DIR or null}, ...]}. Every rank
runs the commands in order through `steadydiff.cli.main`, as `python -m steadydiff.cli ARGV` would, and
writes DIR/NAME.rank{R}.json: {"code": the exit status, "stdout": ..., "stderr": ...}. With "dump", each rank
also writes DUMP/rank{R}.safetensors after `fit` (its model and EMA, keys `model.*` / `ema.*`), outside the
run directory, so a test can check that the replicas agree and that rank 0 wrote the rest.

Each command joins and leaves its own process group, as in its own launch. The groups' rendezvous keys are
kept apart as torchrun keeps its restart attempts apart (steadydiff prefixes them with
TORCHELASTIC_RESTART_COUNT, see utils/distributed.py): here the attempt label is the command's name.
"""

import contextlib
import io
import json
import os
import sys
import traceback
from pathlib import Path

from safetensors.torch import save_file

from steadydiff import cli
from steadydiff.train import loop

_fit = loop.Trainer.fit


def fit_and_dump(dump: Path):
    def fit(self):
        out = _fit(self)
        tensors = {f"model.{k}": v.detach().contiguous() for k, v in self.model.state_dict().items()}
        tensors.update({f"ema.{k}": v.detach().contiguous() for k, v in self.ema.model.state_dict().items()})
        dump.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(dump / f"rank{self.dist.rank}.safetensors"))
        return out

    return fit


def main() -> int:
    plan = json.loads(Path(sys.argv[1]).read_text())
    out, rank = Path(plan["out"]), int(os.environ["RANK"])
    out.mkdir(parents=True, exist_ok=True)
    for command in plan["commands"]:
        os.environ["TORCHELASTIC_RESTART_COUNT"] = command["name"]
        loop.Trainer.fit = fit_and_dump(Path(command["dump"])) if command.get("dump") else _fit
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = cli.main(command["argv"])
            except Exception:  # recorded for the test to show; the next commands still run
                traceback.print_exc()
                code = "exception"
        record = {"code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
        (out / f"{command['name']}.rank{rank}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
