"""What a host runs its lanes with: the model route and upstream, and the worker program.

The one module of the runtime that may import ``fake_pi`` (the contract is in
``pyproject.toml``): with no ``model.base_url`` a host serves Fake-Pi's plain scripted model
itself — the offline, credential-free default of ``pi-runtime serve``, answering by
``model.scenario`` when one is configured — and with
``agent = "fake"`` its workers are Fake-Pi processes. Room lanes and task lanes both start
here; nothing here knows about either (docs/design/index.md, Layout).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import trio

from ._config import ModelConfig, RoomWorkerConfig
from ._errors import ConfigError
from ._pi._launch import ModelRoute, WorkerProgram
from ._pi._pi_install import find_pi

__all__ = ["start_model", "worker_program"]


async def start_model(model: ModelConfig, nursery: trio.Nursery) -> tuple[str, ModelRoute]:
    """The upstream base URL and the frozen route of ``model``; without ``base_url``, Fake-Pi's
    plain scripted model is served in ``nursery`` (offline, no credentials)."""
    base_url = model.base_url
    if base_url is None:
        from fake_pi.model_server import ScriptedModel, serve_model
        from fake_pi.scenario import Scenario

        scenario = Scenario()
        if model.scenario is not None:
            try:
                scenario = Scenario.load(model.scenario)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as error:
                message = f"cannot load {model.scenario}: {error}"
                raise ConfigError("model.scenario", message) from None
        server = await nursery.start(serve_model, ScriptedModel(scenario=scenario))
        base_url = f"{server.url}/v1"
    route = ModelRoute(
        provider=model.provider,
        model=model.model,
        context_window=model.context_window,
        max_tokens=model.max_tokens,
    )
    return base_url, route


def worker_program(config: RoomWorkerConfig) -> WorkerProgram:
    """Fake-Pi, or the real Pi found under ``pi_home`` (``ConfigError`` when it is not)."""
    if config.agent == "fake":
        return WorkerProgram.fake_pi()
    install = find_pi(Path(config.pi_home) if config.pi_home else None)
    if install is None:
        raise ConfigError(
            "pi_home", "the real Pi is not installed there; run `pi-runtime pi install`"
        )
    return WorkerProgram.pi(install)
