# An ms-swift Megatron GKD command line without Ray: vLLM colocated on every rank (vllm_mode colocate).
CUDA_VISIBLE_DEVICES=0,1 \
NPROC_PER_NODE=2 \
megatron rlhf \
    --rlhf_type gkd \
    --model Qwen/Qwen3-8B-Base \
    --teacher_model Qwen/Qwen3-32B \
    --gkd_logits_topk 20 \
    --dataset data/a.jsonl data/b.jsonl \
    --lmbda 1 \
    --beta 1 \
    --micro_batch_size 2 \
    --global_batch_size 16 \
    --max_epochs 1 \
    --lr 5e-5 \
    --use_vllm true \
    --vllm_mode colocate \
    --sleep_level 1 \
    --finetune \
    --no_save_optim \
    --no_save_rng
