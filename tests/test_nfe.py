"""Sampler costs (issue 29 item 4): every registered sampler declares its network evaluations per sample as a
function of steps (`diffusion.network_evaluations`), checked here by counting the calls of a stand-in network;
`steps_for_nfe` is its inverse."""

import pytest
import torch
from torch import nn

from steadydiff.diffusion import FORMULATIONS, network_evaluations, steps_for_nfe
from steadydiff.utils.errors import ConfigError

# Every (formulation, sampler) registered: a sampler added without a declared cost fails here.
SAMPLERS = [(kind, name) for kind, f in FORMULATIONS.items() for name in f.samplers]


class CountingNet(nn.Module):
    """Returns zeros (a valid eps, denoised image or velocity) and counts its calls and their batch sizes."""

    def __init__(self):
        super().__init__()
        self.batches: list[int] = []

    def forward(self, x, t, labels=None):
        self.batches.append(x.shape[0])
        return torch.zeros_like(x)


def test_every_sampler_declares_its_cost():
    for kind, f in FORMULATIONS.items():
        assert set(f.evaluations) == set(f.samplers), f"{kind}: declare EVALUATIONS for every sampler"


@pytest.mark.parametrize("kind,sampler", SAMPLERS)
@pytest.mark.parametrize("steps", [1, 2, 3, 7])
def test_declared_evaluations_equal_counted_calls(kind, sampler, steps):
    formulation = FORMULATIONS[kind]()
    net = CountingNet()
    x_T = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))
    out = formulation.generate(net, x_T, sampler, steps, generator=torch.Generator().manual_seed(1))
    assert out.shape == x_T.shape
    assert net.batches == [3] * len(net.batches)  # one sample costs one call per evaluation
    assert len(net.batches) == network_evaluations(kind, sampler, steps)


@pytest.mark.parametrize("kind,sampler", SAMPLERS)
@pytest.mark.parametrize("nfe", [2, 10, 20, 31, 50])
def test_steps_for_nfe_is_the_most_steps_within_the_budget(kind, sampler, nfe):
    steps = steps_for_nfe(kind, sampler, nfe)
    assert network_evaluations(kind, sampler, steps) <= nfe < network_evaluations(kind, sampler, steps + 1)


def test_steps_for_nfe_known_values_and_errors():
    assert [steps_for_nfe("vp", "dpmpp2m", n) for n in (10, 20, 50)] == [9, 19, 49]
    assert [steps_for_nfe("edm", "heun", n) for n in (10, 20, 50)] == [5, 10, 25]
    assert [steps_for_nfe("flow", "heun", n) for n in (10, 20, 50)] == [5, 10, 25]
    assert steps_for_nfe("edm", "heun", 1) == 1  # one step to sigma = 0 is a single Euler evaluation
    with pytest.raises(ConfigError, match=r"train.eval_nfe: vp sampler ddim needs 2 .* budget 1"):
        steps_for_nfe("vp", "ddim", 1)
    with pytest.raises(ConfigError, match="does not apply to diffusion.kind=vp"):
        network_evaluations("vp", "heun", 3)
