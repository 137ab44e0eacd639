"""The rollout role: the engine servers of a run and generation of a Batch through them.

The spine starts megarl's CPU engine (SGLang's HTTP protocol) as local
subprocesses; the SGLang launcher plugs in behind the same `urls`. Generation
sends one request per row of the (already `rollout.n`-repeated) generation
batch, with a per-row seed derived from the step so runs are reproducible.
"""

from __future__ import annotations

from pathlib import Path


from megarl.controller.phases import assemble_rollout, prompt_token_lists
from megarl.protocol import Batch
from megarl.rollout.client import RolloutClient, results_to_tensors
from megarl.rollout.server import start_cpu_engine


class RolloutFleet:
    def __init__(
        self,
        *,
        model_path: Path,
        tokenizer_path: Path | None,
        num_servers: int,
        host: str,
        api_key: str | None,
        threads: int,
        max_concurrency: int,
        log_dir: Path,
        max_response_length: int,
        pad_token_id: int,
        stop_token_ids: list[int],
        seed: int,
        top_p: float = 1.0,
        top_k: int = -1,
    ):
        self.servers = [
            start_cpu_engine(
                model_path,
                host=host,
                api_key=api_key,
                threads=threads,
                tokenizer_path=tokenizer_path,
                log_path=Path(log_dir) / f"rollout-{index}.log",
            )
            for index in range(num_servers)
        ]
        self.urls = [server.url for server in self.servers]
        self.client = RolloutClient(self.urls, api_key=api_key, max_concurrency=max_concurrency)
        self.max_response_length = max_response_length
        self.pad_token_id = pad_token_id
        self.stop_token_ids = stop_token_ids
        self.seed = seed
        self.top_p, self.top_k = top_p, top_k

    def generate(self, gen_batch: Batch, *, temperature: float, seed: int) -> Batch:
        """Responses, full sequences and engine log-probs for every row of `gen_batch`."""
        results = self.client.generate(
            prompt_token_lists(gen_batch),
            max_new_tokens=self.max_response_length,
            temperature=temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            n=1,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed * 100_003 + seed,
            return_logprob=True,
        )
        tensors = results_to_tensors(results, pad_id=self.pad_token_id, max_response_length=self.max_response_length)
        return assemble_rollout(
            gen_batch,
            responses=tensors["responses"],
            response_lengths=tensors["response_lengths"],
            rollout_log_probs=tensors["rollout_log_probs"],
        )

    def shutdown(self) -> None:
        self.client.close()
        for server in self.servers:
            server.stop()


