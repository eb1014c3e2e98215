"""The config digests of shipped configs stay put, so that results made before are still found (skipped by a sweep,
resumed by a run): every method, task and model of conf/, and the first jobs of every preset, on the shipped tiny
model. tests/shipped_digests.json holds what they were; a change that must change runs' identity (a task's scoring
fixed, say) rewrites it with ``python tests/test_shipped_digests.py`` and says so in its commit; a new config is
pinned with ``python tests/test_shipped_digests.py task=NEW``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import evalkit.config  # noqa: F401 (the resolvers conf/ uses)
from evalkit.core.paths import conf_dir
from evalkit.run import validate
from evalkit.run.digest import config_digest

GOLDEN = Path(__file__).with_name("shipped_digests.json")
SHIPPED = json.loads(GOLDEN.read_text())  # overrides -> config digest


def digests(keys) -> dict[str, str]:
    out = {}
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        for key in keys:
            overrides = [*key.split(), "model.pretrained=builtin:kv_retrieval_tiny"]
            plain = OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)
            out[key] = config_digest(validate(plain, method_explicit="method=" in key))
    return out


def test_every_method_task_and_model_of_conf_is_pinned():
    pinned = {key.split()[0] for key in SHIPPED}
    shipped = {f"{kind}={path.stem}" for kind in ("method", "task", "model") for path in (conf_dir() / kind).glob("*.yaml")}
    assert sorted(shipped - pinned) == []


# ruler_grid's jobs load lm-eval's RULER group (its 13 tasks and nltk's data) for each digest: the slow tier's
@pytest.mark.parametrize("kind", ["method", "task", "model", "+experiment",
                                  pytest.param("+experiment=ruler_grid", marks=pytest.mark.slow)])
def test_shipped_configs_keep_their_digests(kind):
    if kind.startswith("+experiment"):
        ruler = kind.endswith("ruler_grid")
        keys = [key for key in SHIPPED if "+experiment" in key and ("ruler_grid" in key) == ruler]
    else:
        keys = [key for key in SHIPPED if "+experiment" not in key and key.startswith(f"{kind}=")]
    assert keys
    assert digests(keys) == {key: SHIPPED[key] for key in keys}


if __name__ == "__main__":
    keys = sorted(set(SHIPPED) | set(sys.argv[1:]))
    GOLDEN.write_text(json.dumps(digests(keys), indent=1, sort_keys=True) + "\n")
    print(f"rewrote {GOLDEN} ({len(keys)} digests)", file=sys.stderr)
