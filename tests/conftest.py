"""Shared fixtures: tiny models of every architecture and tiny checkpoints built with the real code; the suite's
tiers (markers given per module here, so a test file needs no marker of its own)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from zoo.checkpoint import save_checkpoint
from zoo.lm import LanguageModel
from zoo.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent

_ALSTM = {"hidden_size": 12, "num_layers": 2, "adapt_size": 4, "dropout_hidden": 0.0, "dropout_adapt": 0.0}

#: Tiny constructor arguments per architecture variant (name -> (architecture, arch_args)).
TINY_ARCHS: dict[str, tuple[str, dict]] = {
    "lstm": ("lstm", {"hidden_size": 12, "num_layers": 2}),
    "alstm": ("alstm", dict(_ALSTM)),
    "alstm-lstm": ("alstm", dict(_ALSTM, adaptation_model="lstm")),
    "alstm-ff": ("alstm", dict(_ALSTM, adaptation_model="feedforward")),
    "alstm-output": ("alstm", dict(_ALSTM, policy="output", layer0_wraparound=False)),
    "hyperlstm": ("hyperlstm", {"hidden_size": 12, "num_layers": 1, "hyper_size": 6, "hyper_embedding_size": 3}),
    "hyperlstm-ln": ("hyperlstm", {"hidden_size": 12, "num_layers": 2, "hyper_size": 6, "hyper_embedding_size": 3,
                                   "use_layer_norm": True}),
    "pnorm_gru": ("pnorm_gru", {"hidden_size": 12, "num_layers": 2, "p": 1.0}),
    "pnorm_gru-p2": ("pnorm_gru", {"hidden_size": 12, "num_layers": 2, "p": 2.0}),
}

WORDS = ["<eos>", "<unk>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "N", "mr.", "'s", "n't", "$"]


def tiny_lm(variant: str, vocab_size: int = len(WORDS), emb_size: int = 8, seed: int = 0, **kw) -> LanguageModel:
    arch, args = TINY_ARCHS[variant]
    torch.manual_seed(seed)
    return LanguageModel(vocab_size, arch, dict(args), emb_size=emb_size, **kw)


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer(list(WORDS), "ptb")


#: Numbers computed on another machine (committed fixtures, recorded JSON) are compared with today's to these
#: tolerances, never bit for bit: another CPU's BLAS kernels (another vector width: AVX2, AVX-512) sum in another
#: order. Bit-identity holds on one CPU; every same-machine comparison in the suite stays exact.
#: Scores (``test_compat.py``): the 7th digit moves (measured: 3.8e-7 relative at most); any change of the model's
#: arithmetic moves a score by far more.
CROSS_CPU_REL = 1e-6
#: Training records (train and valid losses, perplexities) of a run that resumes a committed checkpoint
#: (``test_train.py``'s pre-split run). Measured by ``tests/fixtures/pre_split_tolerance.py``, which perturbs that
#: checkpoint: another CPU's rounding (1 to 16 ulps on every weight) moves the final epoch's records by 6.3e-9
#: relative at most (seen on another machine: epoch 1 valid loss 3.708808955881331 vs 3.7088089572058784, 3.6e-10),
#: a resume bug (a lost Adam state, a lost carried state, the data position off by one, the BPTT RNG not
#: restored) by 1.2e-3 at least.
CROSS_CPU_TRAINING_REL = 1e-5
#: The same run's final weights, absolute (a relative bound means nothing for a weight near zero): another CPU's
#: rounding moved them by 1.1e-6 at most, a resume bug by 2.2e-2 at least (the same script).
CROSS_CPU_TRAINING_ABS = 1e-4


#: A small PTB-style corpus written for the tests (lower case, ``<unk>``, ``N``; one sentence a line): for tests
#: that need *some* text in the corpus format, not the real PTB (which may be absent, and is slow to read whole).
CORPUS = REPO / "tests" / "fixtures" / "corpus"


def synthetic_corpus(root: Path, lines: dict[str, int], dataset: str = "ptb") -> Path:
    """A data dir (``root/<dataset>/{train,valid,test}.txt``) with the first ``lines[split]`` lines of the committed
    corpus, cycled when more are asked than it holds; returns ``root``, to pass as ``--data-dir``."""
    (root / dataset).mkdir(parents=True, exist_ok=True)
    for split, n in lines.items():
        have = (CORPUS / f"{split}.txt").read_text(encoding="utf-8").splitlines(keepends=True)
        (root / dataset / f"{split}.txt").write_text("".join(have[i % len(have)] for i in range(n)), encoding="utf-8")
    return root


def real_data(dataset: str = "ptb") -> Path:
    """The real corpus's folder under ``$ZOO_DATA_DIR``, or skip the test saying what is missing: for the tests that
    check numbers of the real data (a bundled model's perplexity, the corpus statistics)."""
    from zoo.data import DataError, resolve_data_dir

    try:
        folder = resolve_data_dir() / dataset
    except DataError:
        pytest.skip(f"needs the real {dataset} corpus: ZOO_DATA_DIR is not set")
    if not all((folder / f"{split}.txt").is_file() for split in ("train", "valid", "test")):
        pytest.skip(f"needs the real {dataset} corpus: {folder}/{{train,valid,test}}.txt not found (ZOO_DATA_DIR)")
    return folder


@pytest.fixture(params=sorted(TINY_ARCHS))
def variant(request) -> str:
    return request.param


@pytest.fixture
def tiny_checkpoint(tmp_path) -> Path:
    """A real checkpoint directory of a tiny (untrained) tied aLSTM with the PTB normalisation."""
    lm = tiny_lm("alstm").eval()
    return save_checkpoint(tmp_path / "tiny-alstm", lm, tiny_tokenizer(), {"name": "tiny-alstm", "dataset": "ptb"})


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add synchronisation (and on a busy 2-core box, waiting). A module
    opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True, scope="session")
def _threads(tmp_path_factory):
    torch.set_flush_denormal(True)
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    # what the suite makes on demand (exports, dynamic evaluation's statistics) stays out of the user's cache
    previous = os.environ.get("ZOO_CACHE_DIR")
    os.environ["ZOO_CACHE_DIR"] = str(tmp_path_factory.mktemp("zoo-cache"))
    yield
    if previous is None:
        os.environ.pop("ZOO_CACHE_DIR", None)
    else:
        os.environ["ZOO_CACHE_DIR"] = previous


# -- tiers ------------------------------------------------------------------------------------------------------
#: Each test module's tier (pyproject.toml's markers say what each means; `make test-fast` runs `-m unit`). A new
#: module must be added here: tests/test_markers.py fails until it is.
MODULE_TIERS: dict[str, str] = {
    **dict.fromkeys([  # (test_lint runs ruff: a Rust binary, a second or two)
        "test_adaptive_linear", "test_agreement", "test_alstm", "test_cards_bundle", "test_checkpoint", "test_cli",
        "test_compat", "test_completions", "test_corpus", "test_data", "test_device", "test_dynamic", "test_fast_paths",
        "test_fused_loss", "test_generation", "test_handler", "test_hf", "test_hyper_graphs", "test_hyperlstm",
        "test_layers", "test_limits", "test_lint", "test_markers", "test_model_cache", "test_models_common",
        "test_pnorm_gru", "test_precision", "test_readme", "test_routes", "test_scheduler", "test_scoring",
        "test_sentences", "test_service", "test_tiers", "test_tokenizer", "test_tokenizer_json",
        "test_toy_architecture", "test_toy_export_format"], "unit"),
    # (test_export, test_ferry: in-process, but their ONNX exports and training runs take minutes)
    **dict.fromkeys([
        "test_app", "test_campaign", "test_corpus_engines", "test_docs", "test_export", "test_ferry", "test_lm_eval",
        "test_onnx_without_torch", "test_openai_api", "test_serving", "test_supervision", "test_train"], "system"),
    "test_browser": "browser",
    # issue 54 (what a newcomer sees): the docs, the offline routes, the API reference's strict build
    **dict.fromkeys(["test_comparable_bits", "test_newcomer_docs", "test_offline_routes"], "unit"),
    **dict.fromkeys(["test_api_reference", "test_demo_messages", "test_wheel_prebuilt"], "system"),
    **dict.fromkeys(["test_hub", "test_wheel"], "hub"),
}

#: Tests of a unit module that belong to another tier (``module::function``): they start a subprocess or a
#: server, or spend more than a few seconds of CPU (the unit tier must run in two minutes on one core).
TEST_TIERS: dict[str, str] = {
    **dict.fromkeys([  # each starts `python -m zoo.cli`, app.py, a benchmark or the harness in a subprocess
        "test_cli::test_score_file_per_line_and_stdin",
        "test_offline_routes::test_cli_download_with_no_network_is_one_line_naming_the_bundled_copy",
        "test_cli::test_default_model_scores_offline_from_the_bundled_copy",
        "test_cli::test_zoo_eval_defaults_reproduce_the_card",
        "test_device::test_harness_command_refuses_a_missing_gpu_with_exit_2",
        "test_device::test_cli_info_says_the_device",
        "test_device::test_cli_refuses_a_missing_gpu_in_one_line",
        "test_device::test_cli_refuses_a_bad_device_in_one_line",
        "test_device::test_demo_refuses_a_missing_gpu_in_one_line",
        "test_device::test_serve_start_refuses_gpus_it_does_not_have",
        "test_device::test_gpu_benchmark_runs_end_to_end_on_the_cpu",
        "test_dynamic::test_api_and_cli",
        "test_dynamic::test_benchmark_quick",
        "test_dynamic::test_benchmark_refuses_an_unknown_model_and_a_quick_run_into_the_results",
        "test_dynamic::test_a_checkpoints_own_settings_are_what_dynamic_true_uses",
        "test_fast_paths::test_reference_switch_by_environment",
        "test_fast_paths::test_without_the_extension_the_python_loop_gives_the_same_numbers",
        "test_fast_paths::test_a_build_lock_left_by_a_killed_build_is_cleared",
        "test_fast_paths::test_a_built_loop_is_loaded_without_the_build_tool",
        "test_hf::test_import_zoo_does_not_import_transformers",
        "test_hf::test_stock_lm_eval_hf_model_reproduces_the_zoos_word_perplexity",
        "test_layers::test_cli_user_error_is_one_line_exit_2_even_under_dash_m",
        "test_layers::test_zoo_debug_shows_the_traceback_of_a_user_error",
        "test_layers::test_checkout_commands_come_from_the_entry_point",
        "test_precision::test_precision_errors_are_clear",
        "test_tiers::test_plots_command_line_draws_both_layouts",
    ], "system"),
    # in-process, 5 to 70 s each on a busy core (gradchecks, overfitting, whole corpora, the bundled models)
    **dict.fromkeys([
        "test_agreement::test_process_and_export_doors_agree_on_every_tiny_architecture",
        "test_agreement::test_every_in_process_door_agrees_on_a_bundled_model_of_each_architecture",
        "test_alstm::test_gradcheck",
        "test_alstm::test_reference_code_slicing_leaves_930k_parameters_unread",
        "test_cards_bundle::test_card_usage_example_is_in_the_corpus_vocabulary",
        "test_hf::test_every_bundled_model_loads_with_the_zoos_tokens_and_loss",
        "test_hf::test_generate_and_pipeline_give_zoo_generates_tokens",
        "test_hyperlstm::test_gradcheck",
        "test_models_common::test_gradcheck_float64",
        "test_models_common::test_overfits_a_tiny_corpus",
        "test_pnorm_gru::test_gradcheck",
        "test_pnorm_gru::test_carried_state_is_unbounded_for_p_above_1",
        "test_sentences::test_sentence_run_end_to_end_and_resume",
        "test_tokenizer::test_char_corpus_splits_read_as_text_encode_to_themselves",
        "test_tokenizer_json::test_tokenizer_json_gives_the_zoo_ids_on_the_corpus_splits",
    ], "system"),
}

TIERS = ("unit", "system", "browser", "hub")


def tier_of(item: pytest.Item) -> str:
    module = item.path.stem
    name = getattr(item, "originalname", item.name)
    return TEST_TIERS.get(f"{module}::{name}") or MODULE_TIERS[module]


def pytest_collection_modifyitems(config, items):
    """Mark every test with its tier. A module missing from MODULE_TIERS gets none (so `-m unit` leaves it out
    until it is placed) and tests/test_markers.py names it."""
    for item in items:
        if item.path.parent.name != "tests" or item.path.stem not in MODULE_TIERS:
            continue
        item.add_marker(getattr(pytest.mark, tier_of(item)))


# -- sharing the suite between the xdist workers ----------------------------------------------------------------
#: Modules whose tests the xdist workers share out one by one (``--dist loadgroup``, the Makefile's): their
#: module-scoped fixtures are cheap (a corpus copy, a tiny checkpoint; made once in each worker that runs them) and
#: their tests independent of each other. Every other module is one unit of work, run whole in one worker with its
#: server or demo started once (as ``--dist loadfile`` ran every module). Measured on these three modules with
#: ``-n 2`` (2 cores, load 4 to 6 from other work): loadfile 345 s, test_train alone on one worker for 332 s while
#: the other was idle after 223 s; loadgroup 316 s, the workers ending 21 s apart. test_train is the suite's
#: longest module (test_serving: 137 s alone; test_app: 61 s).
SHARED_OUT_MODULES = frozenset({"test_train", "test_cli", "test_device"})


@pytest.hookimpl(tryfirst=True)  # before xdist's own choice of scheduler
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadgroup``: a unit of work per module, and one per test of :data:`SHARED_OUT_MODULES`.

    xdist hands out the units with the most tests first (``--loadscope-reorder``, its default), so these single
    tests come last and fill both workers' ends: under ``loadfile`` the suite ended with the last long module alone
    on one worker while the other was idle. (The groups are made here: xdist 3.8 groups ``xdist_group`` markers
    by renaming node ids through an attribute that pytest 9 no longer reads, so under pytest 9.2 its
    ``loadgroup`` spread every test, server modules too.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return nodeid if Path(module).stem in SHARED_OUT_MODULES else module

    return ModuleUnits(config, log)
