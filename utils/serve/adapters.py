"""LoRA adapters loaded and unloaded while ``serve`` runs (library; no side effects): the work
behind utils/serve/app.py's adapter routes. The adapter file is read off the event loop (a
thread), then loaded into the model's engine between two steps (utils/serve/engines.py
``load_adapter``, on the engine process's engine thread); one change at a time. Refusals are
:class:`~utils.serve.protocol.ApiError` s: 403 where runtime changes are locked, 400 for a bad
name or file (naming it and what is wrong), 404 for an unknown model or adapter, 409 for a
name already loaded.

    admin = AdapterAdmin(models, log, runtime=True)
    await admin.load(name, path, model)     its /v1/models entry (model: the base's id; None with one model)
    await admin.unload(name)                {"id", "object": "model", "deleted": true}; name: "base:name" or "name"
    admin.listed()                          every loaded adapter's /v1/models entry
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Optional

from utils.cli import PipelineError
from utils.serve.engines import load_adapter, read_adapter_source, unload_adapter
from utils.serve.protocol import ApiError, adapter_name_problem, clip
from utils.serve.served import ServedModel


def field(body: dict, key: str, required: bool = True) -> Optional[str]:
    """``body[key]``, a non-empty string (None when absent and not ``required``); 400 otherwise."""
    v = body.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, str) or not v.strip():
        raise ApiError(400, f"'{key}' must be a non-empty string.", key, "invalid_value")
    return v


class AdapterAdmin:
    def __init__(self, models: dict[str, ServedModel], log: Callable[[str], None], runtime: bool):
        self.models, self.log, self.runtime = models, log, runtime
        self.lock = asyncio.Lock()

    def listed(self) -> list[dict]:
        return [m.with_adapter(a).describe() for m in self.models.values() for a in list(m.adapters)]

    def _allowed(self) -> None:
        if not self.runtime:
            raise ApiError(403, "loading and unloading adapters needs an API key on a server that listens "
                           "beyond loopback: restart serve with --api-key (or pass --adapter at start).",
                           None, "adapters_locked")

    def _base(self, model: Optional[str]) -> ServedModel:
        if model is None and len(self.models) > 1:
            raise ApiError(400, f"'model' is required: name the base the adapter goes on "
                           f"({', '.join(self.models)}).", "model", "missing_required")
        m = self.models.get(model) if model is not None else next(iter(self.models.values()))
        if m is None:
            raise ApiError(404, f"the model '{clip(model, 80)}' does not exist here ({', '.join(self.models)}).",
                           "model", "model_not_found")
        return m

    def _owner(self, name: str) -> tuple[ServedModel, str]:
        base, colon, short = name.rpartition(":")
        if colon and base in self.models and short in self.models[base].adapters:
            return self.models[base], short
        owners = [m for m in self.models.values() if name in m.adapters]
        if len(owners) == 1:
            return owners[0], name
        loaded = ", ".join(f"{k}:{a}" for k, m in self.models.items() for a in m.adapters) or "none"
        raise ApiError(404, f"no adapter '{clip(name, 80)}' is loaded (loaded: {clip(loaded, 400)}).", "name",
                       "adapter_not_found")

    async def load(self, name: str, path: str, model: Optional[str]) -> dict:
        self._allowed()
        if problem := adapter_name_problem(name):
            raise ApiError(400, f"{problem}.", "name", "invalid_value")
        m = self._base(model)
        async with self.lock:
            if name in m.adapters:
                raise ApiError(409, f"an adapter named '{name}' is already loaded on '{m.id}': unload it first "
                               f"(DELETE /v1/adapters/{m.id}:{name}).", "name", "adapter_exists")
            try:
                entry, source = await asyncio.to_thread(read_adapter_source, path)
                info = await asyncio.to_thread(m.lane.call, load_adapter, name, entry, source)
            except (PipelineError, ValueError) as e:
                raise ApiError(400, f"cannot load adapter '{name}' from {clip(path, 200)}: {clip(str(e), 600)}",
                               "path", "invalid_adapter") from None
            m.adapters[name] = {**info, "created": int(time.time())}
        self.log(f"adapter '{m.id}:{name}' loaded from {clip(source, 200)}")
        return m.with_adapter(name).describe()

    async def unload(self, name: str) -> dict:
        self._allowed()
        async with self.lock:
            m, short = self._owner(name)
            del m.adapters[short]                      # new requests no longer find it
            await asyncio.to_thread(m.lane.call, unload_adapter, short)
        self.log(f"adapter '{m.id}:{short}' unloaded (requests running with it finish with it)")
        return {"id": f"{m.id}:{short}", "object": "model", "deleted": True}
