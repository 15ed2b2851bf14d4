"""The fine-tuning stack: HF Trainer with default arguments, accelerate, TRL's SFTTrainer and PEFT
LoRA, through the model optimize_checkpoints returns (the plan attached in place,
ckptopt.inplace), with batches of every length as a padding collator yields them."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ckptopt import detach, measure_peak, optimize_checkpoints  # noqa: E402
import ckptopt.rewriter as rewriter  # noqa: E402

VOCAB = 256


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=VOCAB, use_cache=False, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).train()


def rows(count: int = 16, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, VOCAB, (int(n),), generator=g).tolist()}
            for n in torch.randint(8, 24, (count,), generator=g)]


def collate(feats: list[dict]) -> dict:
    """Dynamic padding to the longest row, labels masked on the padding (a collator's batch)."""
    n = max(len(f["input_ids"]) for f in feats)
    ids = torch.zeros(len(feats), n, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, f in enumerate(feats):
        ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        att[i, :len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": att, "labels": ids.masked_fill(att == 0, -100)}


class Counted:
    """Counts the segments run under torch.utils.checkpoint."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = rewriter.checkpoint

        def counting(*a, **k):
            self.calls += 1
            return real(*a, **k)

        monkeypatch.setattr(rewriter, "checkpoint", counting)


def _args(out, **over):
    kw = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=4, report_to=[], use_cpu=True,
              save_steps=2, logging_steps=1, disable_tqdm=True)
    kw.update(over)
    return transformers.TrainingArguments(**kw)


def test_the_returned_model_is_the_model_itself():
    model = tiny_llama()
    opt = optimize_checkpoints(model, collate(rows()[:4]))
    assert opt is model and isinstance(opt, transformers.LlamaForCausalLM)
    assert type(opt).__name__ == "LlamaForCausalLM" and opt.plan.checkpoints
    import inspect

    assert list(inspect.signature(opt.forward).parameters)[:2] == ["input_ids", "attention_mask"]
    plain = copy.deepcopy(opt)  # a deep copy is a plain model again: its own forward, its own weights
    assert plain.ckptopt is None
    batch = collate(rows()[:4])
    torch.manual_seed(0)
    a = plain(**batch).loss
    torch.manual_seed(0)
    assert torch.equal(a, opt(**batch).loss)
    detach(opt)
    assert type(opt) is transformers.LlamaForCausalLM and not hasattr(opt, "ckptopt")


def test_trainer_default_arguments_train_like_the_unmodified_model_save_reload_resume(tmp_path, monkeypatch):
    """Trainer reads the forward's signature to keep the batch's columns and checks the model's type
    to save it: with the plan attached in place both just work, and four steps train exactly like
    Trainer on the unmodified model (same seed, same shuffling), with checkpointing on every step."""
    data = rows()
    reference = tiny_llama()
    model = tiny_llama()
    opt = optimize_checkpoints(model, collate(data[:4]))
    counted = Counted(monkeypatch)
    transformers.Trainer(model=reference, args=_args(tmp_path / "ref"), train_dataset=data,
                         data_collator=collate).train()
    trainer = transformers.Trainer(model=opt, args=_args(tmp_path / "ours"), train_dataset=data, data_collator=collate)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    # every step ran checkpointed segments, batches of several lengths and Trainer's num_items_in_batch
    # keyword included (a call structure planned on first sight)
    assert counted.calls >= 4 * 2
    assert not [w for w in seen if "without checkpointing" in str(w.message)]
    theirs = dict(reference.named_parameters())
    for key, p in model.named_parameters():
        assert torch.equal(p, theirs[key]), key
    trainer.save_model(str(tmp_path / "final"))
    assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path / "final"))
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "final"))
    assert type(loaded) is transformers.LlamaForCausalLM
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
    again = transformers.Trainer(model=opt, args=_args(tmp_path / "ours", max_steps=6), train_dataset=data,
                                 data_collator=collate)
    again.train(resume_from_checkpoint=True)  # from the step-4 checkpoint
    assert again.state.global_step == 6


def test_gradient_checkpointing_argument_is_ignored_with_a_note(tmp_path):
    model = tiny_llama()
    opt = optimize_checkpoints(model, collate(rows()[:4]))
    with pytest.warns(UserWarning, match="already checkpointed by ckptopt"):
        transformers.Trainer(model=opt, args=_args(tmp_path, gradient_checkpointing=True, max_steps=2),
                             train_dataset=rows(), data_collator=collate).train()
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_accelerate_loop_trains_like_the_unmodified_model():
    accelerate = pytest.importorskip("accelerate")
    data = rows()
    results = []
    for ours in (False, True):
        model = tiny_llama()
        if ours:
            model = optimize_checkpoints(model, collate(data[:4]))
        acc = accelerate.Accelerator(cpu=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(data, batch_size=4, collate_fn=collate)
        model, opt, loader = acc.prepare(model, opt, loader)
        for batch in loader:
            loss = model(**batch).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        results.append({k: p.detach().clone() for k, p in acc.unwrap_model(model).named_parameters()})
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_sft_trainer_trains(tmp_path):
    trl = pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                               unk_token="<unk>")
    texts = [" ".join(f"w{t - 3}" for t in r["input_ids"]) for r in rows()]
    enc = tok(texts[:4], padding=True, return_tensors="pt")
    batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
             "labels": enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)}
    opt = optimize_checkpoints(tiny_llama(), batch)
    trainer = trl.SFTTrainer(model=opt, train_dataset=Dataset.from_dict({"text": texts}), processing_class=tok,
                             args=trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3,
                                                report_to=[], use_cpu=True, max_length=32, disable_tqdm=True))
    trainer.train()
    assert trainer.state.global_step == 3


@pytest.fixture(scope="module")
def lora():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(tiny_llama(), config)
    reference = copy.deepcopy(model)
    hf = copy.deepcopy(model)
    hf.base_model.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    hf.enable_input_require_grads()
    batch = collate(rows(8, seed=3))
    return peft, optimize_checkpoints(model, batch), reference, hf, batch


def test_lora_trains_identically_and_peaks_below_hf_checkpointing(lora):
    """Frozen base weights save other tensors than trained ones (a frozen linear keeps its weight, not
    its input): the plan, predicted to the byte, peaks below HF's checkpointing of the same PEFT model,
    and the LoRA gradients are the unmodified model's bit for bit."""
    peft, opt, reference, hf, batch = lora
    assert isinstance(opt, peft.PeftModel) and opt.traced.capture.dynamic
    measured, with_hf = measure_peak(opt, batch), measure_peak(hf, batch)
    assert measured - opt.predicted_peak_bytes == 8  # the scalar loss and its gradient
    assert measured <= with_hf
    torch.manual_seed(0)
    reference(**batch).loss.backward()
    torch.manual_seed(0)
    opt(**batch).loss.backward()
    theirs = {k: p.grad for k, p in reference.named_parameters() if p.grad is not None}
    ours = {k: p.grad for k, p in opt.named_parameters() if p.grad is not None}
    assert theirs.keys() == ours.keys() and all("lora_" in k for k in ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    opt.zero_grad(set_to_none=True)


def test_lora_other_sequence_length_is_planned(lora, monkeypatch):
    """Dynamic padding: a batch of another length runs the plan's segments (no fallback warning) and
    predicted_peak_for prices it to the byte."""
    peft, opt, reference, hf, batch = lora
    other = collate(rows(3, seed=5))
    assert other["input_ids"].shape != batch["input_ids"].shape
    counted = Counted(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        opt(**other).loss.backward()
    assert counted.calls > 0
    opt.zero_grad(set_to_none=True)
    assert measure_peak(opt, other) - opt.predicted_peak_for(**other) == 8


def test_trainers_call_is_priced_exactly_and_below_hf_checkpointing(lora):
    """Trainer calls the model with num_items_in_batch (the loss becomes a sum divided by it): that call
    is planned on first sight, predicted_peak_for prices it (planning it if need be) to the byte, and it
    peaks at or below HF's checkpointing. (The logits, returned beside the loss, are no chain tensor
    into the division: chosen so, they had cost a cut, a worse plan and a 1.8% over-prediction.)"""
    peft, opt, reference, hf, batch = lora
    call = dict(batch, num_items_in_batch=(batch["labels"][:, 1:] != -100).sum())
    predicted = opt.predicted_peak_for(**call)
    measured = measure_peak(opt, call)
    assert measured - predicted == 8
    assert measured <= measure_peak(hf, call)
    from ckptopt.inplace import attached

    (variant,) = [v for v in attached(opt)._variants.values() if v is not None]
    assert variant.traced.costs.a[-2] == 4  # the division is handed the scalar loss, not the logits


def test_lora_adapters_save_and_merge(lora, tmp_path):
    peft, opt, reference, hf, batch = lora
    opt.save_pretrained(str(tmp_path))
    assert "adapter_model.safetensors" in os.listdir(tmp_path)
    merged = copy.deepcopy(opt).merge_and_unload()
    assert type(merged) is transformers.LlamaForCausalLM
    with torch.no_grad():
        opt.eval()
        merged.eval()
        assert torch.allclose(merged(**batch).logits, opt(**batch).logits, atol=1e-5)
        opt.train()
