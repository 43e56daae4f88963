"""torchrun worker: build the role layout from megarl arguments and report what each rank got."""

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megarl import distributed  # noqa: E402
from megarl.arguments import parse_args  # noqa: E402


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    args = parse_args(argv)
    context = distributed.init_distributed(args)
    distributed.init_megatron_parallel(context, args.seed)
    report = {
        "rank": context.env.rank,
        "roles": list(context.roles),
        "world_name": context.world_name,
        "world_rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "describe": context.placement.describe(),
    }
    if context.is_train:
        from megatron.core import parallel_state as ps

        report["megatron"] = {
            "tp": ps.get_tensor_model_parallel_world_size(), "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size(),
            "dp_rank": ps.get_data_parallel_rank(),
        }
    if context.cross_role_group is not None:
        # The cross-role group spans every launched rank: the last rank's value reaches all.
        value = torch.tensor([float(context.env.rank)])
        context.cross_role_group.broadcast(value, context.env.world_size - 1).wait()
        report["cross_role_broadcast"] = value.item()
    with open(f"{out}.{context.env.rank}.json", "w") as f:
        json.dump(report, f)
    dist.barrier()
    # as train.py ends: a hard exit once every rank is done. Interpreter teardown with gloo's and
    # the CPU libraries' threads alive aborted once in CI ("terminate called without an active
    # exception", SIGABRT) after the work was written
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
