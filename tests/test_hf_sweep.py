"""benchmarks/hf_sweep.py: the per-model check, in this process, on models that work today."""

import os

import pytest

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks import hf_sweep  # noqa: E402


@pytest.mark.parametrize("name,task", [("GPT2LMHeadModel", "causal"), ("BertForMaskedLM", "masked")])
def test_working_models_are_ok_with_plausible_figures(name, task):
    rec = hf_sweep.run_model(name, task)
    assert rec["status"] == "ok", rec
    assert rec["failed"] == [] and rec["exact"]["identical"] and rec["exact"]["max_rel_diff"] is None
    assert rec["front_end"] == "export" and rec["layers"] > 2
    assert 100_000 < rec["params"] < hf_sweep.MAX_PARAMS
    assert abs(rec["prediction_error"]) <= hf_sweep.PRED_TOL
    assert abs(rec["measured_peak_bytes"] - rec["predicted_peak_bytes"]) <= 0.01 * rec["predicted_peak_bytes"]
    # checkpointing: below the unmodified model, at or below HF's own, recomputing no more than HF
    assert rec["measured_peak_bytes"] < rec["none_peak_bytes"]
    assert rec["supports_hf_checkpointing"] and rec["hf_recompute"] == "every layer"
    assert 0.5 < rec["peak_ratio_vs_hf"] <= 1.0
    assert 0 <= rec["recompute_flops"] <= rec["hf_recompute_flops"]
    assert rec["recompute_share"] >= 0.0  # (with the segments' fixed cost: above 1/3 on tiny models)
    # the batch a collator yields: one padded row
    assert rec["batch"]["input_ids"] == [hf_sweep.BATCH, hf_sweep.SEQ]


def test_a_model_the_harness_cannot_build_is_classified_harness():
    rec = hf_sweep.run_model("SpeechEncoderDecoderModel", "speech")  # needs encoder and decoder configs
    assert rec["status"] == "harness" and rec["cause"].startswith("harness: ") and rec["reason"]
    rec = hf_sweep.run_model("NoSuchModelForCausalLM", "causal")
    assert rec["status"] == "harness" and "no class" in rec["reason"]


def test_failures_group_by_normalized_message():
    a = hf_sweep.normalize("node add_3 at model.layers.0 has shape [2, 32, 64] (0x7f3a)")
    b = hf_sweep.normalize("node add_17 at model.layers.1 has shape [4, 16, 128] (0x55aa)")
    assert a == b
    assert hf_sweep.normalize("T5Config has no attribute x") == "T5Config has no attribute x"


def test_summary_groups_records():
    recs = [dict(model="A", task="causal", status="ok", prediction_error=0.0, measured_peak_bytes=10,
                 predicted_peak_bytes=10, peak_ratio_vs_hf=0.9, recompute_share=0.1),
            dict(model="B", task="causal", status="fail", cause="optimize: X: y"),
            dict(model="C", task="causal", status="fail", cause="optimize: X: y"),
            dict(model="D", task="image", status="harness", cause="harness: z")]
    s = hf_sweep.summarize(recs)
    assert s["models"] == 4 and s["built"] == 3 and s["by_status"] == {"ok": 1, "fail": 2, "harness": 1}
    assert s["causes"]["optimize: X: y"] == dict(status="fail", count=2, examples=["B", "C"])
    assert s["ok_peak_ratio_vs_hf"]["median"] == 0.9 and s["ok_exact_predictions"] == 1


def test_a_dead_static_chain_across_layers_traces():
    """JambaForCausalLM computes a mask from attention_mask that no layer reads (dead code): its first
    op was left in a layer of its own and the next, placed in a later layer, was not passed its value
    ("internal: node to is used by a layer but not passed to it"). Dead static ops with no placed
    static input now run before the first layer."""
    from ckptopt import trace

    model, batch, _ = hf_sweep.build("JambaForCausalLM", "causal", None)
    tm = trace(model, batch)
    assert tm.n > 2 and tm.costs.n == tm.n
