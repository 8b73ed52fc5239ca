"""A minimal driver for a compiled artifact on any TVM device (the host runtime,
``edgekv.runtime.HostRuntime``, is CPU-only): the same calls — caches allocated once on the
device, one ``prefill_block`` per block of ≤ B tokens, ``decode`` per token."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


class DeviceRuntime:
    def __init__(self, lib, manifest: dict, params: list[tuple[str, np.ndarray]], device):
        import tvm
        from tvm import relax

        self.manifest, self.device = manifest, device
        if manifest.get("extra_rows"):
            raise NotImplementedError(f"this driver does not fill the {manifest['extra_rows']} pseudo rows of a "
                                      f"'{manifest['policy']['name']}' artifact; use edgekv.runtime.HostRuntime's "
                                      "step_block as the model (docs/COMPILER.md, Pseudo rows)")
        self.block = int(manifest["block"])
        self.num_layers = int(manifest["num_layers"])
        self.vm = relax.VirtualMachine(lib, device)
        arrays = dict(params)
        self.params = [tvm.runtime.tensor(np.ascontiguousarray(arrays[p["name"]]), device) for p in manifest["params"]]
        if manifest["policy"]["name"] == "d2o":
            raise ValueError("a D2O artifact needs its per-prompt layer budgets (the first-block probe); run it "
                             "with edgekv.runtime.HostRuntime(artifact, device=tvm.cuda()) and its prefill")
        fields = manifest.get("cache_fields", [["k", "float32"], ["v", "float32"], ["pos", "int32"], ["fill", "int32"]])
        self.stride = len(fields)
        self.caches = []
        for c in manifest["cache"]:
            self.caches += [tvm.runtime.tensor(np.zeros(c[f], dt), device) for f, dt in fields]
        self.position = 0

    @classmethod
    def load(cls, artifact: str | Path, device):
        """Load an artifact directory (``model.tar`` is linked by TVM with the system compiler)."""
        import tvm
        from safetensors.numpy import load_file

        path = Path(artifact)
        manifest = json.loads((path / "manifest.json").read_text())
        lib = tvm.runtime.load_module(str(path / manifest["files"]["library"]["name"]))
        arrays = load_file(str(path / manifest["files"]["params"]["name"]))
        return cls(lib, manifest, list(arrays.items()), device)

    def _t(self, a):
        import tvm

        return tvm.runtime.tensor(a, self.device)

    def step_block(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        n = ids.size
        tok = np.zeros((self.block,), np.int64)
        tok[:n] = ids
        pos = np.arange(self.position, self.position + self.block, dtype=np.int64)
        out = self.vm["prefill_block"](self._t(tok), self._t(pos), self._t(np.array([n], np.int32)),
                                       *self.caches, *self.params)
        self.position += n
        return out[0].numpy()

    def decode(self, token_id: int) -> np.ndarray:
        out = self.vm["decode"](self._t(np.array([token_id], np.int64)), self._t(np.array([self.position], np.int64)),
                                *self.caches, *self.params)
        self.position += 1
        return out[0].numpy()

    def kept_positions(self, layer: int) -> np.ndarray:
        fill = int(self.caches[self.stride * layer + 3].numpy()[0])
        return self.caches[self.stride * layer + 2].numpy()[:, :fill]
