"""Recipe section `rollout.async`: generation runs ahead of training, on weights at most k versions old.

Present, a producer keeps the fleet busy with prompt groups while the trainer
trains on the oldest complete groups; `max_staleness: 0` is the synchronous loop.
It needs disaggregated placement (`placement.colocate: false`): colocated roles
take turns on the same devices, so there is nothing to overlap. The section is
spelled `async` in a recipe (a Python keyword, hence the field name `async_`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, NonNegativeInt

from megarl.config.training import Section


class RolloutCorrectionConfig(Section):
    """The importance weight between the proximal (trainer) and behaviour (rollout) policies of a stale token."""

    mode: Literal["truncate", "mask", "off"] = Field(
        "truncate", description="truncate: w = min(rho, cap) (TIS); mask: tokens with rho > cap leave the loss "
        "(MIS); off: no correction"
    )
    level: Literal["token", "sequence"] = Field(
        "token", description="one weight per token, or one per sequence (the product of its token ratios)"
    )
    cap: float = Field(2.0, ge=1.0, description="the bound C of the weight (>= 1)")


class AsyncRolloutConfig(Section):
    """How far generation may run ahead of training, and how weight updates meet running requests."""

    max_staleness: NonNegativeInt = Field(
        1, description="k: how many weight versions a trained sample may lag behind the trainer; 0 = synchronous"
    )
    in_flight_updates: bool = Field(
        False, description="sync weights while generation is paused in place (pause_generation mode in_place, then "
        "continue_generation): running requests keep their cache and go on under the new weights"
    )
    partial_rollouts: bool = Field(
        False, description="without in_flight_updates: a weight update aborts running requests and re-sends each "
        "as prompt plus the tokens generated so far (else the update waits for them to finish)"
    )
    correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig, description="off-policy correction of stale tokens"
    )


# `rollout.async` in YAML, `rollout.async_` in Python.
ASYNC_FIELD = Field(None, alias="async", description="asynchronous RL: rollout runs ahead of training (needs "
                    "placement.colocate: false); null = one synchronous step after another")
ALIAS_CONFIG = ConfigDict(serialize_by_alias=True, validate_by_alias=True, validate_by_name=False)
