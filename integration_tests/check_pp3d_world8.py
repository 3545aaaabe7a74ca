"""Manual check, not collected by pytest (CI runs world sizes 2 and 4 only): 3-D PP x FSDP x TP
(p2d2t2, 8 gloo ranks; fine on 2 cores, ~5 minutes) reproduces world 1 for 5 SFT steps.

    python integration_tests/check_pp3d_world8.py

Last run (2026-11-22, 2 cores): max loss diff 1.5e-07, max weight diff 3.9e-06 vs world 1.
"""

import importlib.util
import json
import tempfile
from pathlib import Path

from shardforge.algorithms.testing import tiny_assets
from shardforge.algorithms.trainers.sft import run_sft
from shardforge.mesh.testing import get_rank_pool

spec = importlib.util.spec_from_file_location("ppl", str(Path(__file__).with_name("test_pipeline_layouts.py")))
ppl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ppl)

if __name__ == "__main__":
    root = Path(tempfile.mkdtemp())
    _tiny = tiny_assets(root, seed=5, layers=4, max_operand=30, num_eval=20, data_seed=4)
    train, ev = _tiny["train"], _tiny["eval"]
    assets = {"model": str(root / "model"), "train": str(train), "eval": str(ev)}
    run_sft(ppl._config(assets, root / "w1", "d1"))
    get_rank_pool(8).run(ppl._run, ppl._config(assets, root / "p2d2t2", "p2d2t2"), timeout_s=1200)
    a, b = ppl._curves(root / "w1"), ppl._curves(root / "p2d2t2")
    wa, wb = ppl._weights(root / "w1"), ppl._weights(root / "p2d2t2")
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    print(
        json.dumps(
            {
                "world1_train": a[0],
                "p2d2t2_train": b[0],
                "max_loss_diff": max(abs(x - y) for x, y in zip(a[0], b[0])),
                "max_weight_diff": worst,
            }
        )
    )
