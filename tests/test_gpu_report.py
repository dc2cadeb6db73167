"""scripts/gpu_report.py (rag_lab/bench/gpu_report/): `--device cpu --quick --stage all` runs every stage at toy
size in a fresh process, and each fragment's numbers are checked against an independent computation (token counts
from the toy tokenizer, encoder FLOPs by hand, a float64 brute-force top-k, the reader's parameters from plain
transformers, the toy world's own files); the process imports nothing the GPU image lacks beyond the carried wheels;
`--assemble` lists exactly the stages whose fragments exist; wheels resolve and install as documented; a new stage is
one new `*_stage.py` file."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from rag_lab.bench.gpu_report import (
    cli,
    common,
    document,
    embed_stage,
    forward_stage,
    scale_base_stage,
    scale_stage,
    search_stage,
    stages,
    step_stage,
    wheels,
)

from conftest import drop_in

# one xdist worker runs the whole file: its stages run once, in the module fixture
pytestmark = pytest.mark.xdist_group("test_gpu_report")

ROOT = Path(__file__).resolve().parents[1]


def lacking_on_gpu_image() -> set[str]:
    """The project's dependencies (extras included) that are neither on the GPU image nor among the wheels."""
    import importlib.metadata

    from packaging.requirements import Requirement

    declared = {wheels.normalise(Requirement(x).name) for x in importlib.metadata.requires("rag-train")}
    carried = {wheels.normalise(spec.split("==")[0]) for spec in wheels.wheel_requirements()}
    return declared - wheels.GPU_IMAGE - carried


def site_view_without(names: set[str], view: Path) -> dict[str, str]:
    """{site-packages folder: a folder of links to all its entries except the files of the installed
    distributions `names`}: put in its place on sys.path, those distributions are gone, as on the GPU image
    (import, importlib.util.find_spec and importlib.metadata all miss them)."""
    import importlib.metadata

    hidden: dict[Path, set[str]] = {}
    for name in names:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        site = Path(dist.locate_file("")).resolve()
        hidden.setdefault(site, set()).update(
            Path(f).parts[0] for f in dist.files or [] if not str(f).startswith(".."))
    views = {}
    for i, (site, entries) in enumerate(hidden.items()):
        folder = view / str(i)
        folder.mkdir(parents=True)
        for entry in site.iterdir():
            if entry.name not in entries:
                (folder / entry.name).symlink_to(entry)
        views[str(site)] = str(folder)
    return views


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """Every stage, as CI runs them, in a process of their own in which the project's dependencies that the
    GPU image lacks (and no wheel carries) are hidden; also the top-level modules it imported."""
    tmp = tmp_path_factory.mktemp("gpu-report")
    out, work = tmp / "fragments", tmp / "work"
    hidden = lacking_on_gpu_image()
    views = site_view_without(hidden, tmp / "site-view")
    code = textwrap.dedent(f"""
        import importlib, json, os, sys
        views = {views!r}
        sys.path[:] = [views.get(os.path.realpath(p), p) for p in sys.path]
        importlib.invalidate_caches()
        from rag_lab.bench.gpu_report.cli import main
        main(["--device", "cpu", "--quick", "--stage", "all", "--out", {str(out)!r}, "--work", {str(work)!r},
              "--wheels-dir", {str(tmp / "no-wheels")!r}])
        print("MODULES " + json.dumps(sorted({{m.split(".")[0] for m in sys.modules}})))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    modules = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("MODULES "))[8:])
    records = {name: json.loads((out / f"{name}.json").read_text()) for name in stages.STAGES}
    return {"out": out, "work": work, "modules": modules, "records": records, "hidden": hidden, "views": views}


def test_every_stage_wrote_its_fragments_on_cpu_quick(quick_run):
    for name, record in quick_run["records"].items():
        assert record["stage"] == name and record["quick"] is True
        assert record["environment"]["device"] == "cpu"
        markdown = (quick_run["out"] / f"{name}.md").read_text()
        assert markdown.startswith(f"## {name}:") and "device: cpu (quick)" in markdown


def test_embed_counts_every_passage_at_exactly_its_length_and_the_rates_follow(quick_run):
    from transformers import AutoTokenizer

    record = quick_run["records"]["embed"]
    work = quick_run["work"] / "embed"
    tokenizer = AutoTokenizer.from_pretrained(str(work / "toy" / "tokenizer"))
    peak = record["gemm_peak_flops"]
    assert [(r["shape"], r["length"]) for r in record["results"]] == [("tiny", 64), ("tiny", 128), ("tiny", 256)]
    for r in record["results"]:
        rows = [json.loads(line) for line in (work / f"long-{r['length']}.jsonl").read_text().splitlines()]
        assert len(rows) >= r["passages"]
        lengths = [len(tokenizer(row["text"])["input_ids"]) for row in rows[: r["passages"]]]
        assert min(lengths) > r["length"]  # every passage is truncated: the forward sees exactly length tokens each
        assert r["profile"]["rows"] == r["passages"] and r["profile"]["tokens"] == r["passages"] * r["length"]
        # the toy tower by hand: d 64, 4 heads x 16, gated feed-forward 128 (3 matrices), 2 layers
        n = r["length"]
        flops = 2 * (2 * n * (4 * 64 * 64 + 3 * 64 * 128) + 2 * 2 * n * n * 64)
        assert r["flops_per_passage"] == flops
        assert r["ours_passages_per_s"] == pytest.approx(r["passages"] / r["ours_seconds"])
        assert r["ours_fraction_of_peak"] == pytest.approx(flops * r["passages"] / r["ours_seconds"] / peak)
        assert r["max_abs_diff"] < 1e-4  # embed_rows and SentenceTransformer.encode give the same vectors
        assert sum(r["profile"]["share"].values()) == pytest.approx(1.0)
        assert r["ours_kernel"] == "eager" and set(r["kernels"]) == {"eager", "flex"}  # auto on CPU: eager
        for timed in r["kernels"].values():
            assert timed["fraction_of_peak"] == pytest.approx(flops * r["passages"] / timed["seconds"] / peak)
        # fp32 on CPU: FlexAttention's vectors are eager's, on these passages and on padded batches of toy ones
        assert r["min_cosine_flex_vs_eager"] > 0.9999 and r["padded_min_cosine_flex_vs_eager"] > 0.9999
        cached = r["cached"]  # from the token cache: the bytes of the tokenising pass, at its own rate
        assert cached["max_abs_diff"] == 0.0
        assert cached["passages_per_s"] == pytest.approx(r["passages"] / cached["seconds"])
        assert cached["fraction_of_peak"] == pytest.approx(flops * r["passages"] / cached["seconds"] / peak)
    assert len(record["goals"]) == 3 and record["goals"][2]["goal"].startswith("tiny tower, ids from the token cache")
    assert record["goals"][0]["value"] is None and all(goal["met"] is None for goal in record["goals"])
    assert "| tower | tokens | eager psg/s | of peak | flex psg/s |" in (quick_run["out"] / "embed.md").read_text()


def test_forward_rates_follow_the_hand_counted_flops_and_the_tokeniser_truncates(quick_run):
    record = quick_run["records"]["forward"]
    peak = record["gemm_peak_flops"]
    assert [(r["shape"], r["length"]) for r in record["results"]] == [("tiny", 16), ("tiny", 32)]
    for r in record["results"]:
        n = r["length"]  # the toy tower by hand, as in the embed test above
        flops = r["rows"] * 2 * (2 * n * (4 * 64 * 64 + 3 * 64 * 128) + 2 * 2 * n * n * 64)
        assert r["autocast_fraction_of_peak"] == pytest.approx(flops / r["autocast_seconds"] / peak)
        assert r["bf16_fraction_of_peak"] == pytest.approx(flops / r["bf16_seconds"] / peak)
        shares = r["device_time_shares"]
        assert sum(shares.values()) == pytest.approx(1.0) and set(shares) == set(forward_stage.KERNEL_CLASSES)
        assert shares["GEMM, fp32"] > 0 and shares["GEMM, 16-bit"] == 0  # CPU: no autocast, every GEMM in fp32
        assert r["min_cosine_bf16_vs_autocast"] > 0.99
        assert r["attention"] == "eager" and r["min_cosine_sdpa_vs_eager"] > 0.9999  # fp32 on CPU: the same vectors
    assert [t["length"] for t in record["tokenise"]] == [16, 32]


@pytest.mark.parametrize("name, kind", [
    # kernel names read off an H100 profile of the base tower (docs/generated/gpu_report.md) and CPU aten ops
    ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize64x64x8_stage3_warpsize1x4x1", "GEMM, fp32"),
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "GEMM, 16-bit"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "GEMM, 16-bit"),
    ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 8, false, false>", "softmax"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "fused attention"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16> >",
     "the rest (elementwise, norms, copies)"),
    ("aten::addmm", "GEMM, fp32"), ("aten::bmm", "GEMM, fp32"), ("aten::mul", "the rest (elementwise, norms, copies)"),
])
def test_kernel_classes(name, kind):
    assert forward_stage.kernel_class(name) == kind


def test_search_top_k_equals_a_float64_brute_force(quick_run):
    from rag_lab.bench.search import make_corrector

    record = quick_run["records"]["search"]
    s = record["settings"]
    rows = torch.randn(s["rows"], s["dim"], generator=torch.Generator().manual_seed(s["seed"]))
    rows = torch.nn.functional.normalize(rows, dim=1).double()
    query = torch.nn.functional.normalize(torch.randn(s["batch"], s["dim"], generator=torch.Generator().manual_seed(
        s["seed"] + 1)), dim=1)[0].double()
    corrector = make_corrector(s["dim"], s["hidden"], s["seed"]).double()
    w1, b1, w2, b2 = (p.detach() for p in (corrector.first.weight, corrector.first.bias, corrector.second.weight,
                                           corrector.second.bias))
    corrected = rows + torch.relu(rows @ w1.t() + b1) @ w2.t() + b2  # h(b) = b + W2 relu(W1 b + c1) + c2
    for mode, vectors in (("exact", rows), ("corrector_full", corrected), ("corrector_fused", corrected)):
        brute = np.argsort(-(vectors @ query).numpy(), kind="stable")[: s["k"]]
        assert sorted(record["results"][mode]["top_rows_query0"]) == sorted(brute.tolist()), mode
    assert record["results"]["exact"]["same_ids_as_plain"] == record["results"]["corrector_full"]["same_ids_as_plain"]
    assert record["results"]["corrector_full"]["same_ids_as_plain"] == 1.0
    assert record["results"]["corrector_fused"]["identical_rows_as_unfused"] == 1.0


def test_step_runs_the_recipe_at_1_and_4_questions_with_the_stated_models(quick_run):
    from transformers import T5Config, T5ForConditionalGeneration

    results = quick_run["records"]["step"]["results"]
    assert [r["shape"]["batch"] for r in results] == [1, 4]
    reader = T5ForConditionalGeneration(T5Config(vocab_size=1000, d_model=64, d_ff=128, d_kv=16, num_heads=4,
                                                 num_layers=2, num_decoder_layers=2, feed_forward_proj="gated-gelu",
                                                 tie_word_embeddings=False))
    for r in results:
        assert r["parameters"]["reader"] == sum(p.numel() for p in reader.parameters())
        assert r["parameters"]["corrector"] == 2 * 64 * 32 + 32 + 64  # h: 64 -> 32 -> 64
        assert r["check"]["allclose"] is True
        for logged in r["step"]["logged"]:
            assert {"reader_loss", "retriever_loss", "corrector_loss"} <= set(logged)
            assert all(math.isfinite(logged[k]) for k in ("reader_loss", "retriever_loss", "corrector_loss"))
        assert r["likelihoods"]["saving_s"] == pytest.approx(r["likelihoods"]["reencode_median_s"]
                                                             - r["likelihoods"]["reuse_median_s"])


@pytest.mark.parametrize("stage", ["scale", "scale_base"])
def test_scale_runs_the_main_job_over_the_whole_generated_world(quick_run, stage):
    record = quick_run["records"][stage]
    r = record["results"]
    rows = record["settings"]["rows"]
    world = quick_run["work"] / stage / f"toy-{rows}" / "passages.jsonl"
    assert r["rows"] == rows == len(world.read_text().splitlines())
    run = r["run"]
    assert [(p["reason"], p["rows"]) for p in run["corpus_passes"]] == [("token cache build", rows),
                                                                       ("stale buffer build", rows),
                                                                       ("final evaluation", rows)]
    assert run["steps"] == record["settings"]["steps"] == run["loop_calls"]["buffer search"]
    factor = scale_stage.TARGET_ROWS / rows
    assert r["projection"]["generate"] == pytest.approx(r["generate_seconds"] * factor)
    for i, stage in enumerate(("token cache build", "buffer build")):
        assert r["projection"][stage] == pytest.approx(run["corpus_passes"][i]["seconds"] * factor)


def test_stages_ran_without_what_the_gpu_image_lacks(quick_run):
    """The run above had the lacking dependencies hidden (datasets, deepspeed, ... where installed here) and still
    imported the carried ones (omegaconf: the config) from their usual place."""
    import importlib.metadata

    assert {"datasets", "fastapi", "uvicorn"} <= quick_run["hidden"]
    assert "omegaconf" not in quick_run["hidden"] and "omegaconf" in quick_run["modules"]
    owners = importlib.metadata.packages_distributions()
    imported = {wheels.normalise(d) for m in quick_run["modules"] for d in owners.get(m, [])}
    assert not imported & quick_run["hidden"]
    assert quick_run["views"]  # something was hidden: datasets is installed where the tests run


def test_assemble_lists_exactly_the_stages_present(quick_run, tmp_path):
    doc = tmp_path / "all.md"
    cli.main(["--assemble", "--out", str(quick_run["out"]), "--doc", str(doc)])
    text = doc.read_text()
    for name in stages.STAGES:
        assert f"\n## {name}:" in text
    assert text.count("device: cpu (quick)") == len(stages.STAGES)
    assert "Missing stages: none." in text and "GPU figures pending a GPU session" in text

    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("embed", "search"):
        for suffix in (".json", ".md"):
            shutil.copy(quick_run["out"] / f"{name}{suffix}", partial)
    cli.main(["--assemble", "--out", str(partial), "--doc", str(doc)])
    text = doc.read_text()
    assert "\n## embed:" in text and "\n## search:" in text
    assert "\n## step:" not in text and "\n## scale:" not in text
    assert "Missing stages: forward, step, scale, scale_base." in text
    assert "| step | **missing** |" in text and "| scale | **missing** |" in text
    assert "## Findings" not in text
    (partial / document.NOTES).write_text("## Findings\n\nwhy the figures are what they are\n")
    cli.main(["--assemble", "--out", str(partial), "--doc", str(doc)])
    text = doc.read_text()  # the hand-written findings right after the summary table, before the first stage
    assert text.index("Missing stages:") < text.index("## Findings\n\nwhy the figures") < text.index("\n## embed:")


def test_list_and_bad_input(capsys, tmp_path, monkeypatch):
    cli.main(["--stage", "list"])
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == [*stages.STAGES, "all"]
    assert listed[-1].split()[1] == f"~{sum(s.minutes for s in stages.STAGES.values()):g}"

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--assemble", "--out", str(tmp_path)])
    assert exit_info.value.code == common.INPUT_FAULT_EXIT
    assert capsys.readouterr().err.strip() == f"error: {tmp_path}: no stage fragments (<stage>.json) to assemble"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--stage", "search", "--device", "cuda", "--out", str(tmp_path),
                         "--wheels-dir", str(tmp_path / "none")])
    assert exit_info.value.code == common.INPUT_FAULT_EXIT
    assert capsys.readouterr().err.strip().startswith("error: --device cuda, but torch sees no CUDA device")

    with pytest.raises(SystemExit) as exit_info:  # GPU sizes on a CPU: refused before any work
        cli.main(["--stage", "search", "--device", "cpu", "--out", str(tmp_path),
                         "--wheels-dir", str(tmp_path / "none")])
    assert exit_info.value.code == common.INPUT_FAULT_EXIT
    assert capsys.readouterr().err.strip().startswith("error: --device cpu runs only with --quick")
    assert not list(tmp_path.iterdir())  # no fragment written


NEW_STAGE = '''
"""Test stage: counts to three, at toy size or not."""

from rag_lab.bench.gpu_report.common import Stage, register


def stage_count(ctx):
    return {"gemm_peak_flops": 2e12, "gemm_peak_how": "none", "settings": {"quick": ctx.quick},
            "results": {"count": 3, "work": ctx.work.name}, "goals": []}


def render_count(record):
    return [f"counted to {record['results']['count']} in {record['results']['work']}"]


STAGE = register(Stage(name="count", order=25, minutes=0.5, what="counts to three", run=stage_count,
                       render=render_count, scales="constant"))
'''

# Runs in a fresh interpreter with the new module's folder added to the package's search path before the package
# (and its discovery) is imported: exactly what a new `count_stage.py` in rag_lab/bench/gpu_report/ does.
STAGE_DRIVER = drop_in("rag_lab.bench.gpu_report") + '''
import json, sys
from pathlib import Path

from rag_lab.bench.gpu_report import cli, stages

folder = Path(sys.argv[1])
out = {"stages": list(stages.STAGES), "modules": sorted(m for m in sys.modules if m.startswith("rag_lab.bench.gpu"))}
cli.main(["--stage", "list"])
cli.main(["--stage", "count", "--device", "cpu", "--quick", "--out", str(folder / "out"), "--wheels-dir",
          str(folder / "no-wheels")])
cli.main(["--assemble", "--out", str(folder / "out"), "--doc", str(folder / "doc.md")])
print("RESULT " + json.dumps(out))
'''


def test_a_new_stage_is_one_file(tmp_path):
    """A `count_stage.py` dropped into the package is registered in its declared order, listed, run through the
    command's stage selection and assembled; a module of the folder not named `*_stage.py` is not imported."""
    (tmp_path / "count_stage.py").write_text(NEW_STAGE)
    (tmp_path / "helpers.py").write_text("raise RuntimeError('not a stage: never imported')\n")
    proc = subprocess.run([sys.executable, "-c", STAGE_DRIVER, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out["stages"] == ["embed", "forward", "count", "search", "step", "scale", "scale_base"]  # order 25
    assert "rag_lab.bench.gpu_report.count_stage" in out["modules"]
    assert "rag_lab.bench.gpu_report.helpers" not in out["modules"]
    listed = [line.split()[0] for line in proc.stdout.splitlines()
              if not line.startswith(("RESULT", "stage ", "wrote"))]
    assert listed == out["stages"] + ["all"]
    record = json.loads((tmp_path / "out" / "count.json").read_text())
    assert record["stage"] == "count" and record["quick"] and record["results"] == {"count": 3, "work": "count"}
    assert (tmp_path / "out" / "count.md").read_text().startswith("## count: counts to three\n")
    doc = (tmp_path / "doc.md").read_text()
    assert "counted to 3 in count" in doc and "| count | cpu (quick) |" in doc
    assert "Missing stages: embed, forward, search, step, scale, scale_base." in doc
    assert "--stage count --device cuda" in doc  # the commands section names it too


def test_registering_a_stage_name_twice_fails():
    again = common.Stage(name="embed", order=99, minutes=1, what="again", run=lambda ctx: {}, render=lambda r: [],
                         scales="-")
    with pytest.raises(TypeError, match="gpu_report stage name 'embed' is registered twice"):
        common.register(again)
    assert stages.STAGES["embed"] is embed_stage.STAGE


def test_wheel_requirements_follow_requirements_beyond_the_image():
    needs = {"faiss-cpu": ["numpy", "packaging"],
             "omegaconf": ["PyYAML>=5.1", "antlr4-python3-runtime==4.9.*; python_version < '3.13'",
                           "dataclasses; python_version < '3.7'"],
             "ir-measures": ["pytrec-eval-terrier>=0.5", "cwl-eval>=1.0; extra == 'cwl'"],
             "pytrec-eval-terrier": ["numpy", "scipy"], "antlr4-python3-runtime": None}
    versions = {"faiss-cpu": "1.8", "omegaconf": "2.3.0", "ir-measures": "0.4.3", "pytrec-eval-terrier": "0.5.11",
                "antlr4-python3-runtime": "4.9.3"}
    assert wheels.wheel_requirements(needs.get, versions.__getitem__) == [
        "antlr4-python3-runtime==4.9.3", "faiss-cpu==1.8", "ir-measures==0.4.3", "omegaconf==2.3.0",
        "pytrec-eval-terrier==0.5.11"]


def test_install_wheels_installs_only_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    folder = tmp_path / "wheels"
    folder.mkdir()
    name = "rag_train_probe_pkg"
    with zipfile.ZipFile(folder / f"{name}-0.1-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{name}/__init__.py", "VALUE = 42\n")
        whl.writestr(f"{name}-0.1.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        whl.writestr(f"{name}-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                    "Tag: py3-none-any\n")
        whl.writestr(f"{name}-0.1.dist-info/RECORD", "")
    (folder / "numpy-0.0-py3-none-any.whl").write_bytes(b"not a wheel: numpy is installed, so never opened")
    target = tmp_path / "site"
    assert wheels.install_wheels(folder, target) == [wheels.normalise(name)]
    assert sys.path[0] == str(target)
    import importlib

    assert importlib.import_module(name).VALUE == 42
    sys.modules.pop(name)
    assert wheels.install_wheels(tmp_path / "absent", target) == []


def test_the_gpu_sizes_are_accepted_by_the_code_they_configure():
    """The GPU-size settings never run here: what can be checked without a GPU is that the benchmarks' own
    parsers and the config loader accept them, so a lease is not spent on a typo."""
    from rag_lab.bench import rlm_step, search
    from rag_lab.bench.embed import SHAPES
    from rag_train.config import load_config
    from rag_train.train.schema import RLMConfig

    args = search.parse_args(search_stage.SEARCH_GPU + ["--device", "cuda"])
    assert (args.rows, args.dim, args.hidden, args.batch, args.dtype) == (28_000_000, 768, 8192, 64, "bf16")
    for batch in step_stage.STEP_BATCHES:
        args = rlm_step.parse_args(step_stage.STEP_GPU + ["--batch", str(batch), "--device", "cpu"])
        assert (args.size, args.passages, args.passage_length, args.dtype, args.checkpointing, args.batch) == (
            "base", 32, 256, "bf16", True, batch)
    assert set(embed_stage.EMBED_GPU["shapes"]) | set(forward_stage.FORWARD_GPU["shapes"]) <= set(SHAPES) == {
        "tiny", "small", "base"}
    cfg = load_config(RLMConfig, ROOT / "configs" / "toy" / "rlm.yaml", scale_stage.SCALE_GPU["overrides"])
    assert (cfg.buffer.embed_workers, cfg.warm_start.reader_steps, cfg.pdist_gate) == (8, 200, 0.0)
    cfg = load_config(RLMConfig, ROOT / "configs" / "toy" / "rlm.yaml", scale_base_stage.SCALE_BASE_GPU["overrides"])
    for tiny in (cfg.retriever.tiny, cfg.reader.tiny):
        assert (tiny.d_model, tiny.num_heads, tiny.d_kv, tiny.d_ff, tiny.num_layers) == (768, 12, 64, 3072, 12)
    assert (cfg.reader.tiny.num_decoder_layers, cfg.strategy.corrector.hidden) == (12, 8192)
    assert scale_base_stage.SCALE_BASE_GPU_ROWS >= 500_000
