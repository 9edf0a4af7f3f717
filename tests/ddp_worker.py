"""`steadydiff train` under torchrun that also dumps each rank's final weights (used by test_distributed.py).

    torchrun --standalone --nproc_per_node=2 tests/ddp_worker.py DUMP_DIR train --out RUN ...

Each rank writes DUMP_DIR/rank{R}.safetensors (its model and EMA, keys `model.*` / `ema.*`) after `fit`,
outside the run directory, so the test can check that the replicas agree and that rank 0 wrote the rest.
"""

import sys
from pathlib import Path

from safetensors.torch import save_file

from steadydiff import cli
from steadydiff.train import loop

dump = Path(sys.argv[1])
_fit = loop.Trainer.fit


def fit_and_dump(self):
    out = _fit(self)
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in self.model.state_dict().items()}
    tensors.update({f"ema.{k}": v.detach().contiguous() for k, v in self.ema.model.state_dict().items()})
    dump.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dump / f"rank{self.dist.rank}.safetensors"))
    return out


loop.Trainer.fit = fit_and_dump
sys.exit(cli.main(sys.argv[2:]))
