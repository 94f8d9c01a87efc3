"""The sampler as a policy (``asyncrl.image.flow``): a step's log-probability is the
Gaussian's, evaluated directly; and on data whose velocity field is known in closed form
(a Gaussian), the SDE's samples have the marginals of the ODE's and of the data, whatever
the noise level."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.image.flow import (
    gaussian_logprob,
    ode_step,
    sde_distribution,
    sde_sigma,
    sde_step,
    time_grid,
)

MU, S = 1.5, 0.5  # the data: N(MU, S^2) in every dimension


def velocity(x: torch.Tensor, t: float) -> torch.Tensor:
    """E[eps - x0 | x_t = x] for x0 ~ N(MU, S^2): x_t is jointly Gaussian with both."""
    var = (1 - t) ** 2 * S**2 + t**2
    centred = x - (1 - t) * MU
    x0 = MU + (1 - t) * S**2 / var * centred
    eps = t / var * centred
    return eps - x0


def test_the_time_grid_runs_from_noise_to_data_as_sd3_spaces_it():
    grid = time_grid(10, shift=3.0)
    assert len(grid) == 11 and grid[0] == 1.0 and grid[-1] == 0.0
    assert all(a > b for a, b in zip(grid, grid[1:]))
    assert grid[5] > 0.5  # shifted toward high noise


def test_a_step_s_logprob_is_the_gaussian_s():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 3, 8, 8, generator=g)
    grid = time_grid(10, shift=3.0)
    for t, t_next in ((grid[0], grid[1]), (grid[4], grid[5]), (grid[-2], grid[-1])):
        x_next, logprob = sde_step(x, v, t, t_next, 0.7, grid[1], generator=g)
        mean, std = sde_distribution(x, v, t, t_next, 0.7, grid[1])
        direct = torch.distributions.Normal(mean, std).log_prob(x_next).flatten(1).sum(1)
        torch.testing.assert_close(logprob, direct, rtol=1e-5, atol=1e-3)
        want = sde_sigma(torch.tensor(t), grid[1], 0.7) * math.sqrt(t - t_next)
        assert float(std) == pytest.approx(float(want), rel=1e-5)
    # Another point is less likely than the sample's own mean.
    assert (gaussian_logprob(mean, mean, std) > gaussian_logprob(mean + std, mean, std)).all()


@pytest.mark.parametrize("noise_level", [0.3, 0.7])
def test_the_sde_keeps_the_ode_s_marginals(noise_level):
    g = torch.Generator().manual_seed(1)
    grid = time_grid(200)
    start = torch.randn(20000, 1, generator=g)
    ode, sde = start.clone(), start.clone()
    halfway = None
    for t, t_next in zip(grid, grid[1:]):
        ode = ode_step(ode, velocity(ode, t), t, t_next)
        sde, _ = sde_step(sde, velocity(sde, t), t, t_next, noise_level, grid[1], generator=g)
        if halfway is None and t_next <= 0.5:
            halfway = (t_next, sde.mean().item(), sde.std().item(), ode.std().item())
    for samples in (ode, sde):
        assert samples.mean().item() == pytest.approx(MU, abs=0.03)
        assert samples.std().item() == pytest.approx(S, abs=0.03)
    t, mean, std, ode_std = halfway
    assert mean == pytest.approx((1 - t) * MU, abs=0.03)
    assert std == pytest.approx(math.sqrt((1 - t) ** 2 * S**2 + t**2), abs=0.03)
    assert std == pytest.approx(ode_std, abs=0.03)
