# A verl launch script in the style of its examples: shell variables, Hydra overrides, `$@` and a pipe.
set -x
gsm8k_train_path=$HOME/data/gsm8k/train.parquet
gsm8k_test_path=$HOME/data/gsm8k/test.parquet
train_files="['$gsm8k_train_path']"
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$train_files" \
    data.val_files="$gsm8k_test_path" \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=5 \
    algorithm.use_kl_in_reward=False \
    trainer.logger='["console","tensorboard"]' \
    trainer.n_gpus_per_node=8 \
    trainer.total_epochs=15 $@ 2>&1 | tee log.txt
