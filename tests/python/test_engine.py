"""The example engine (managedkv.engine): the step token budget (the founders' prefill included: a
founder it does not cover goes on in chunks) and the joiners' chunk size hold, arrivals join in
flight or begin the next request, and --verify fails when a token differs from the dense model's."""

import json
import os
import tempfile
import unittest

import torch

from managedkv import engine, parity

CPU = torch.device("cpu")


def tiny_llama():
    return parity.TinyLlama.random(parity.SIZES["tiny"], 0, CPU)


def tokens(n, seed):
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class BudgetTest(unittest.TestCase):
    def test_each_step_stays_within_the_budget_and_the_chunk(self):
        paged = engine.PagedEngine(tiny_llama(), 64, chunk=16, max_batched_tokens=18, keep_logits=False)
        recorded = []
        original = paged.forward

        def forward(rows, new_tokens):
            recorded.append([len(t) for t in new_tokens])
            return original(rows, new_tokens)

        paged.forward = forward
        founders = [engine.Sequence("a", tokens(40, 1), 12), engine.Sequence("b", tokens(30, 2), 12)]
        joiners = [engine.Sequence("c", tokens(70, 3), 3, arrival=0), engine.Sequence("d", tokens(50, 4), 3, arrival=1)]
        for seq in founders:
            seq.arrival = 0
        paged.serve(founders, joiners)
        self.assertTrue(all(sum(counts) <= 18 for counts in recorded), recorded)
        # The prefill step spends the budget on the founders in order: "a" takes all 18, "b" none;
        # both publish their first chunk, hold at completePrefill and go on in chunks as joiners.
        self.assertEqual(recorded[0], [18, 0])
        self.assertEqual(paged.metrics()["held_prefills"], 2)
        decode_steps = recorded[1:]
        self.assertTrue(all(max(counts, default=0) <= 16 for counts in decode_steps), decode_steps)
        # Rows prefilling at once under a budget of 18: a row the budget leaves out holds.
        self.assertTrue(any(0 in counts and len(counts) == 4 for counts in decode_steps), decode_steps)
        self.assertGreater(founders[0].prefill_chunks, 1)
        self.assertGreater(joiners[0].prefill_chunks, 1)
        self.assertEqual(len(founders[1].generated), 12)
        self.assertEqual(len(joiners[0].generated), 3)
        self.assertEqual(paged.metrics()["in_flight_joins"], 2)


class ConfigTest(unittest.TestCase):
    def test_sliding_layers_without_reuse_are_refused_before_anything_is_made(self):
        model = engine.build_model("gemma3", "tiny", 0, CPU, torch.float32)
        with self.assertRaisesRegex(ValueError, "reuse=False with sliding-window layers"):
            engine.PagedEngine(model, 64, reuse=False)


class ArrivalTest(unittest.TestCase):
    def test_a_late_arrival_begins_the_next_request(self):
        paged = engine.PagedEngine(tiny_llama(), 64, keep_logits=False)
        early = engine.Sequence("early", tokens(20, 5), 2, arrival=0)
        late = engine.Sequence("late", tokens(20, 6), 2, arrival=50)  # after "early" finished
        paged.submit(early)
        paged.submit(late)
        paged.run()
        self.assertEqual(paged.metrics()["in_flight_joins"], 0)
        self.assertEqual(late.token_steps[0], 50)  # began at its arrival: the engine idled until then
        self.assertEqual((len(early.generated), len(late.generated)), (2, 2))


class VerifyTest(unittest.TestCase):
    def run_main(self, extra=()):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "engine.json")
            argv = ["--model", "llama", "--turns", "2", "--conversations", "4", "--verify", "--json", path]
            status = engine.main([*argv, *extra])
            with open(path) as file:
                return status, json.load(file)

    def test_verify_passes_and_fails_on_a_wrong_token(self):
        status, report = self.run_main()
        self.assertEqual(status, 0)
        self.assertEqual(report["mismatched_sequences"], [])
        original = engine.PagedEngine.pick
        calls = []

        def pick(paged, logits):
            calls.append(1)
            token = original(paged, logits)
            return (token + 1) % 128 if len(calls) == 30 else token

        engine.PagedEngine.pick = pick
        try:
            status, report = self.run_main()
        finally:
            engine.PagedEngine.pick = original
        self.assertEqual(status, 1)
        self.assertEqual(len(report["mismatched_sequences"]), 1)

    def test_an_expected_figure_that_stays_zero_fails(self):
        status, report = self.run_main(["--expect", "evicted_records"])  # 48 pages: nothing evicted
        self.assertEqual(status, 1)
        self.assertFalse(report["engaged"]["evicted_records"])


class FlexContractTest(unittest.TestCase):
    """attention="flex" on this torch (without FlexAttention): the engine's mask over the pool's
    physical layout, read through the views' physical-to-logical map, under dense stand-ins that
    follow FlexAttention's documented semantics (the mask_mod decides each (query, key) pair; GQA
    by repeating KV heads). The parity must hold on every path, as with the gathered pages."""

    @staticmethod
    def create_block_mask(mask_mod, batch, heads, q_len, kv_len, device=None):
        return mask_mod(None, None, torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :])

    @staticmethod
    def flex_attention(q, k, v, block_mask=None, scale=None, enable_gqa=False):
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        scores = (q @ k.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~block_mask, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v

    def test_the_flex_path_reads_the_pool_through_the_page_map(self):
        saved = engine._create_block_mask, engine._flex_attention
        engine._create_block_mask, engine._flex_attention = self.create_block_mask, self.flex_attention
        try:
            for model in ("llama", "gemma3", "hybrid"):
                with tempfile.TemporaryDirectory() as folder:
                    path = os.path.join(folder, "parity.json")
                    status = parity.main(["--model", model, "--attention", "flex", "--json", path])
                    with open(path) as file:
                        report = json.load(file)
                self.assertEqual(status, 0, model)
                self.assertEqual(report["attention"], "flex")
                self.assertLess(report["max_abs_logit_diff"], 1e-4, model)
        finally:
            engine._create_block_mask, engine._flex_attention = saved


if __name__ == "__main__":
    unittest.main()
