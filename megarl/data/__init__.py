"""What a run reads and writes as samples. Imports go one way: sources -> datasets -> prompts.

    sources.py   the prompts of each training step and the evaluation sets (built-in task or files)
    datasets.py  JSONL / Parquet files in ColossalChat, verl and ms-swift layouts, one normalised Row
    prompts.py   the Prompt record the rollout receives, chat-template rendering
    tasks/       the built-in arithmetic task (problems, answers, \\boxed{} extraction)
    dumps.py     the rollout and evaluation JSONL dumps
"""
