"""Every preset of conf/experiment/ launches only jobs that run: evalkit's sweeper (evalkit/run/sweeper.py) leaves out
the method/budget pairs a job's own start refuses, before any job starts, so no preset prints a skipped line and the
count its first line announces is the count of jobs that run.

The jobs that run are those the basic sweeper ran before, less the ones it skipped: both sides are computed here with
the code as it is (the product of the preset's params, each job put through the check ``evalkit.cli.evaluate`` runs;
the sweeper's jobs), and compared by their config digests, so that results made before are still found. The presets'
hub models are not here: every job names the shipped tiny model's weights (``model.pretrained``), which every job's
digest then holds alike. The fast tier checks each preset on part of its grid (every method and budget, fewer tasks
or lengths), the slow tier whole, and runs one tiny sweep for real."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest
from helpers import evalkit
from hydra import initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

from evalkit.cli import method_was_chosen
from evalkit.core.errors import ConfigError
from evalkit.core.paths import conf_dir
from evalkit.run import precheck, validate
from evalkit.run.digest import config_digest
from evalkit.run.sweeper import job_configs, planned, selected

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "sweeps.md"
PRESETS = sorted(path.stem for path in (conf_dir() / "experiment").glob("*.yaml"))
TINY = "model.pretrained=builtin:kv_retrieval_tiny"  # offline: the presets' hub models are not in this cache
CHUNK = 12  # methods checked at a time in the fast tier (baselines_grid's registered ones, kvpress_leaderboard's)


def registered_methods() -> list[str]:
    import evalkit.compression as ec

    return sorted(ec.POLICIES)


def preset_methods(preset: str) -> list[str]:
    return OmegaConf.load(conf_dir() / "experiment" / f"{preset}.yaml").hydra.sweeper.params.method.split(",")


def by_chunks(methods: list[str]) -> list[str]:
    """``method=...`` overrides sweeping ``methods``, CHUNK at a time."""
    return ["method=" + ",".join(methods[i:i + CHUNK]) for i in range(0, len(methods), CHUNK)]


# The fast tier's part of each grid: every method and budget the preset sweeps, on fewer tasks, lengths or modes.
PARTS = {
    "baselines_grid": [("task=aime24", method) for method in by_chunks(registered_methods())],
    "kvpress_leaderboard": [(method,) for method in by_chunks(preset_methods("kvpress_leaderboard"))],
    "reasoning_grid": [("task=aime24",)],
    "ruler_grid": [("model.max_context=4096", "compression_scope=prompt")],
    "scbench_grid": [("task=scbench_kv",)],
    "leaderboard_small": [("+experiment/leaderboard_task=needle",)],
}
LARGE = ("baselines_grid", "scbench_grid", "leaderboard_small")  # hundreds of jobs: composed and checked in minutes
FAST = [pytest.param(preset, part, id=f"{preset}-{i}" if len(PARTS.get(preset, [()])) > 1 else preset)
        for preset in PRESETS for i, part in enumerate(PARTS.get(preset, [()]))]


@contextlib.contextmanager
def hydra_here():
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        yield GlobalHydra.instance().config_loader()


def sweep_config(loader, *overrides: str):
    """The sweep's config as ``evalkit -m OVERRIDES`` composes it before its sweeper runs (Hydra's multirun mode: the
    swept values are the sweeper's)."""
    return loader.load_configuration("config", list(overrides), RunMode.MULTIRUN)


def basic_product(config) -> list[list[str]]:
    """The jobs Hydra's basic sweeper made of this sweep: every combination of the params, then the command line."""
    params = [f"{key}={value}" for key, value in config.hydra.sweeper.params.items()]
    overrides = OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task])
    return BasicSweeper.split_arguments(overrides, None)[0]


def started(plain: dict, job: list[str]):
    """What a job's start did with its config (evalkit.cli.evaluate, before the run): the spec, or None where it
    skipped the job."""
    explicit = method_was_chosen(job)
    try:
        return validate(plain, method_explicit=explicit, checked=precheck(plain, explicit, sweeping=True))
    except ConfigError:
        return None


def ran_before_and_now(preset: str, part: tuple[str, ...], digest=config_digest) -> tuple[list, list, int]:
    """The config digests of the jobs the basic sweeper's product ran (those the old check did not skip), those of the
    jobs the preset's sweep launches now, and the count of the product. A job's digest is computed once, from its
    config: a job launched now that is no job of the product is composed and digested on its own."""
    with hydra_here() as loader:
        config = sweep_config(loader, f"+experiment={preset}", TINY, *part)
        product = basic_product(config)
        ran = {tuple(job): spec for job, plain in job_configs(config, product, loader)
               if (spec := started(plain, job)) is not None}
        digests = {job: digest(spec) for job, spec in ran.items()}
        now = planned(config).jobs
        others = [job for job in now if tuple(job) not in digests]
        for job, plain in job_configs(config, others, loader):
            spec = started(plain, job)
            assert spec is not None, f"the sweep launches a job its start refuses: {job}"
            digests[tuple(job)] = digest(spec)
    return sorted(digests[job] for job in ran), sorted(digests[tuple(job)] for job in now), len(product)


def check_preset(preset: str, part: tuple[str, ...], digest=config_digest) -> None:
    before, now, product = ran_before_and_now(preset, part, digest)
    assert now == before and len(set(now)) == len(now)
    assert 0 < len(now) <= product


@pytest.mark.parametrize("preset, part", FAST)
def test_a_preset_launches_the_jobs_that_ran_before_less_the_skipped_ones_with_their_digests(preset, part):
    if preset == "ruler_grid":  # its digest loads lm-eval's 13 RULER tasks (their data builders, ~20 s once): slow tier
        check_preset(preset, part, digest=lambda spec: json.dumps(spec.flat_config(), sort_keys=True, default=str))
    else:
        check_preset(preset, part)


@pytest.mark.slow(reason="every preset whole: baselines_grid's 540 jobs and scbench_grid's 576 take minutes")
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_whole_launches_the_jobs_that_ran_before_less_the_skipped_ones(preset):
    check_preset(preset, ())


def test_the_product_presets_select_evalkits_sweeper_and_the_list_presets_need_none():
    """A preset that sweeps method x budget selects the sweeper; quick_grid and sessions_quick sweep a list of
    method/budget pairs (conf/experiment/method_budget/) whose every job runs."""
    with hydra_here() as loader:
        chosen = {preset: selected(sweep_config(loader, f"+experiment={preset}")) for preset in PRESETS}
    assert chosen == {preset: preset not in ("quick_grid", "sessions_quick") for preset in PRESETS}


@pytest.mark.parametrize("preset", PRESETS)
def test_the_sweepers_job_configs_are_the_configs_hydra_composes_for_them(preset):
    """The sweeper composes each choice of config groups once and sets the other overrides on it with Hydra's code:
    the configs are those Hydra's launcher composes for the jobs, for the first and last jobs and one in between."""
    with hydra_here() as loader:
        config = sweep_config(loader, f"+experiment={preset}", TINY)
        product = basic_product(config)
        jobs = [product[0], product[len(product) // 2], product[-1]]
        for job, plain in job_configs(config, jobs, loader):
            hydras = loader.load_sweep_config(config, job)
            with open_dict(hydras):
                del hydras["hydra"]
            assert plain == OmegaConf.to_container(hydras, resolve=True), job


def test_a_job_the_sweeper_leaves_out_is_named_with_what_its_start_would_have_said():
    """On the tiny model's 256 tokens, 8x leaves SnapKV a cache no larger than its window: that job is left out with
    the line its start would have said; full x budgets and the methods without one are counted as pairs."""
    with hydra_here() as loader:
        config = sweep_config(loader, "+experiment=paper_grid", "task=kv_retrieval", "model=kv_retrieval_tiny",
                              "method=full,streaming_llm,snapkv", "budget=none,4x,8x")
        sweep = planned(config)
    assert [[o for o in job if o.startswith(("method=", "budget="))] for job in sweep.jobs] == [
        ["method=full", "budget=none"], ["method=streaming_llm", "budget=4x"], ["method=streaming_llm", "budget=8x"],
        ["method=snapkv", "budget=4x"]]
    assert sweep.left_out_line() == (
        "left out: 4 method/budget pairs that do not exist (a budget for a method that takes none, or none for one "
        "that needs it); refused: method=snapkv budget=8x: SnapKV.capacity must be > window (32), got 32")


def test_the_sweep_launches_the_jobs_its_first_line_counts(tmp_path, capsys):
    """Hydra's multirun with evalkit's sweeper and progress callback, each job a function that notes its overrides:
    the header counts the jobs launched, the pairs left out are said once and no job is launched for them."""
    launched = []

    def job(cfg) -> None:
        from hydra.core.hydra_config import HydraConfig

        launched.append(list(HydraConfig.get().overrides.task))

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        GlobalHydra.instance().hydra.multirun(
            config_name="config", task_function=job, with_log_configuration=False,
            overrides=["+experiment=paper_grid", "task=aime24", TINY, f"hydra.sweep.dir={tmp_path}",
                       "hydra/job_logging=none", "hydra/hydra_logging=none"])
    said = capsys.readouterr()
    header = re.search(r"evalkit: sweep of (\d+) jobs over method, budget\n  left out: (\d+) method/budget pairs",
                       said.out)
    assert header and (int(header[1]), int(header[2])) == (10, 6), said.out
    assert len(launched) == 10 and "skipped" not in said.out + said.err
    assert {(job[1], job[2]) for job in launched} == {("method=full", "budget=none")} | {
        (f"method={method}", f"budget={budget}") for method in ("streaming_llm", "snapkv", "snapstream")
        for budget in ("2x", "4x", "8x")}


def test_a_sweep_none_of_whose_jobs_can_run_is_one_config_error(tmp_path):
    result = evalkit("-m", "+experiment=paper_grid", "task=kv_retrieval", "model=kv_retrieval_tiny", "method=full",
                     "budget=2x,4x", f"results_dir={tmp_path / 'results'}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                     cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "evalkit: config error: no job of this sweep can run: method=full takes no budget; drop +budget or pick a "
        "compressing method"]
    assert "sweep of" not in result.stdout and not (tmp_path / "results").exists()


@pytest.mark.slow(reason="a real sweep: two runs of the tiny model (about 40 s on 2 cores)")
def test_a_preset_sweep_runs_what_it_announces_and_skips_nothing(tmp_path):
    """``evalkit -m +experiment=paper_grid`` on the tiny model and task, two methods x two budgets: the two pairs
    that exist run, the other two are counted on the header's second line, and no line says skipped."""
    from evalkit.results import read_table

    results = tmp_path / "results"
    result = evalkit("-m", "+experiment=paper_grid", "model=kv_retrieval_tiny", "task=kv_retrieval",
                     "method=full,snapkv", "budget=none,2x", "limit=2", f"results_dir={results}",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "evalkit: sweep of 2 jobs over method, budget"
    assert lines[1].startswith("  left out: 2 method/budget pairs that do not exist")
    assert "skipped" not in result.stdout + result.stderr
    assert "sweep done: 2 of 2 jobs (2 ran)" in result.stdout
    runs = read_table(results, "metrics").drop_duplicates("run_id")
    assert sorted(zip(runs["method"], runs["budget"].fillna("none"))) == [("full", "none"), ("snapkv", "2x")]


# -- docs/sweeps.md ---------------------------------------------------------------------------------------------------
def page_sweeps() -> list[tuple[str, int | None]]:
    """Each ``evalkit -m`` command of the page, in its bash blocks and its text, with the job count it is said to make
    (``7 jobs`` in its comment, ``(2 jobs)`` after it in the text), or None."""
    text = PAGE.read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in re.sub(r"\s*\\\n\s*", " ", block).splitlines():
            command, _, comment = line.partition("  #")
            count = re.search(r"(\d+) jobs", comment)
            found.append((command.strip(), int(count[1]) if count else None))
    for command, count in re.findall(r"`(evalkit -m\s[^`]+)`(?:\s+\((\d+) jobs\))?", text):
        found.append((" ".join(command.split()), int(count) if count else None))
    return [(command, count) for command, count in found if command.startswith("evalkit -m ")]


def preset_rows() -> dict[str, str]:
    """The page's table of presets: each preset and what its jobs column says."""
    return dict(re.findall(r"^  \| `(\w+)` \| ([^|]+?) \|", PAGE.read_text(), flags=re.M))


def test_the_pages_table_names_every_preset():
    assert sorted(preset_rows()) == PRESETS, "docs/sweeps.md's table of presets: one row per conf/experiment/ preset"


def page_count(preset: str) -> int:
    """The jobs the page's table gives ``preset``; baselines_grid's is a formula over the registered methods."""
    said = preset_rows()[preset]
    if preset != "baselines_grid":
        return int(said)
    import evalkit.compression as ec

    assert said == "3 x (M x 3 + B)"
    takes = sum(ec.POLICIES[name].takes_budget for name in ec.POLICIES)
    return 3 * (takes * 3 + len(ec.POLICIES) - takes)


@pytest.mark.parametrize("preset", [p for p in PRESETS if p not in LARGE])
def test_the_pages_count_of_a_preset_is_the_jobs_it_runs(preset):
    with hydra_here() as loader:
        assert len(planned(sweep_config(loader, f"+experiment={preset}")).jobs) == page_count(preset)


@pytest.mark.slow(reason="baselines_grid's 720 jobs and scbench_grid's 576 compose and check in minutes")
@pytest.mark.parametrize("preset", [p for p in PRESETS if p in LARGE])
def test_the_pages_count_of_a_large_preset_is_the_jobs_it_runs(preset):
    with hydra_here() as loader:
        assert len(planned(sweep_config(loader, f"+experiment={preset}")).jobs) == page_count(preset)


def test_every_sweep_the_page_shows_makes_the_jobs_it_says():
    """Each ``evalkit -m`` command of the page makes as many jobs as the page says (kvpress_leaderboard's, which it
    does not count, on two methods: the fast tier's share)."""
    sweeps = page_sweeps()
    assert len(sweeps) >= 8 and all(len(command.split()) > 2 for command, _ in sweeps)
    with hydra_here() as loader:
        for command, count in sweeps:
            overrides = [a for a in command.split()[2:] if "=" in a]
            if "+experiment=kvpress_leaderboard" in overrides:
                overrides.append("method=full,snapkv")
            config = sweep_config(loader, *overrides, TINY)
            jobs = planned(config).jobs
            assert jobs and (count is None or len(jobs) == count), (command, len(jobs), count)
