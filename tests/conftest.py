import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Compiled code goes to the tests' cache, never the user's: set here, before the first rank starts the forkserver whose
# environment every later rank inherits (a per-test monkeypatch reaches only ranks of a forkserver started after it)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "behemoth-test-cache", "inductor"))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Tokenized corpora go to a per-session cache, never the user's."""
    monkeypatch.setenv("BEHEMOTH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


# Larger worlds and repeated variants of checks the default run already makes at its smallest world: each parallel
# feature keeps its single-process equivalence test in the default run (2 processes, or 1), and these run with
# `OMP_NUM_THREADS=1 python -m pytest -q -m slow` (README, Tests). They keep the whole default run near 15 minutes
# on 2 cores.
SLOW_VARIANTS = {
    "test_architecture.py::test_two_models_train_side_by_side_on_disjoint_sub_meshes",
    "test_checkpoint.py::test_resume_continues_the_curve[4]",
    "test_cli.py::test_resume_on_four_processes_and_export",
    "test_composition.py::test_pairs_train_the_single_process_curve[4]",
    "test_composition.py::test_pairs_train_the_single_process_curve[8]",
    "test_data_parallel.py::test_data_parallel_matches_single_process[4]",
    "test_generate.py::test_tensor_and_pipeline_parallel_generation_equals_single_process[llama-4-2-2]",
    "test_hf.py::test_cli_trains_hf_llama_with_tensor_parallel",
    "test_hf.py::test_weights_from_save_pretrained_directory[gpt2-parallel.zero_stage=3]",
    "test_hf.py::test_weights_from_save_pretrained_directory[llama-parallel.tp=2]",
    "test_moe_training.py::test_gpt_moe_4_processes_matches_single_process[plan1]",
    "test_moe_training.py::test_gpt_moe_4_processes_matches_single_process[plan2]",
    "test_offload.py::test_offload_composes[2-extra0]",
    "test_offload.py::test_offload_composes[2-extra1]",
    "test_pipeline_exec.py::test_hugging_face_models_at_p2[llama-options0-1f1b]",
    "test_pipeline_exec.py::test_three_dimensional_pp_dp_tp_on_eight_processes[1]",
    "test_pipeline_exec.py::test_three_dimensional_pp_dp_tp_on_eight_processes[2]",
    "test_pipeline_exec.py::test_schedule_matches_single_process[gpipe-4]",
    "test_pipeline_exec.py::test_schedule_matches_single_process[1f1b-4]",
    "test_pipeline_exec.py::test_schedule_matches_single_process[interleaved-4]",
    "test_pipeline_exec.py::test_schedule_matches_single_process[zb-h1-4]",
    "test_pipeline_exec.py::test_schedule_matches_single_process[chimera-4]",
    "test_pipeline_exec.py::test_tied_embeddings_stay_tied[4-interleaved]",
    "test_pipeline_exec.py::test_tied_embeddings_stay_tied[4-chimera]",
    "test_pipeline_exec.py::test_zero_stage_1_across_data_parallel_pipelines[chimera]",
    "test_pipeline_exec.py::test_zero_stage_2_across_data_parallel_pipelines[zb-h1]",
    "test_pipeline_exec.py::test_zero_stage_2_across_data_parallel_pipelines[interleaved]",
    "test_planner_memory.py::test_predicted_memory_matches_measured[4]",
    "test_same_run.py::test_resume_with_dropout_is_bit_for_bit[background-save]",
    "test_tensor_parallel.py::test_pp2_tp2_sequence_parallel_variants[options0-zb-h1]",
    "test_tensor_parallel.py::test_pp2_tp2_sequence_parallel_variants[options1-1f1b]",
    "test_tensor_parallel.py::test_tp_checkpoint_resumes_on_another_layout[4-extra2]",
    "test_zero.py::test_zero_matches_single_process[1-4]",
    "test_zero.py::test_zero_matches_single_process[2-4]",
    "test_zero.py::test_zero_matches_single_process[3-4]",
}


def pytest_collection_modifyitems(config, items):
    """Mark the SLOW_VARIANTS slow, and fail the run if one of them no longer names a test (a rename must update it)."""
    found = set()
    for item in items:
        key = f"{item.path.name}::{item.name}"
        if key in SLOW_VARIANTS:
            item.add_marker(pytest.mark.slow)
            found.add(key)
    if any("::" in arg for arg in config.args):  # tests picked by node id: the rest of their files is not collected
        return
    files = {item.path.name for item in items}
    missing = sorted(k for k in SLOW_VARIANTS - found if k.split("::")[0] in files)
    if missing:
        raise pytest.UsageError(f"tests/conftest.py SLOW_VARIANTS names tests that do not exist: {', '.join(missing)}")


@pytest.fixture(scope="module")
def gpt_tiny_generator():
    """gpt-tiny (context 192) loaded for inference with a small paged cache, shared by a module's serving tests."""
    from behemoth.config import load_config
    from behemoth.inference import CachePolicy, load
    from behemoth.inference.loading import Source

    gen = load(Source(load_config(None, ["model=gpt-tiny", "model.context=192"]), None, None), cache=CachePolicy(block_size=8, memory_mb=2))
    yield gen
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
