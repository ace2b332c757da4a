"""Real SGLang layers and models in this process, without an engine: a gloo world of one.

SGLang 0.5.23 reads its parallel and runtime context when a layer is constructed, so building
``LlamaForCausalLMEagle3`` or ``DeepseekV2Model`` by hand needs a distributed world and a published
runtime context first (what SGLang's own ``sglang.test.layer_ut_utils`` does, minus its dependency
on ``datasets``). Used by tests that check hs_tracer against SGLang's real classes.
"""

from __future__ import annotations

import os
import socket


def init_world_of_one() -> None:
    """Prepare the CPU runtime, start a gloo world of size 1 and publish a CPU runtime context.
    Call before importing SGLang in a fresh process."""
    from hs_tracer_testbed.runtime.launcher import prepare_process

    prepare_process()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1, device="cpu"), role="test",
            ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")
