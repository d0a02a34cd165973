"""Training recipes for the models the project ships (``spec_engine.zoo``); the runtime never imports this package.

python -m spec_engine.training.train          # the embedded default pair (target + draft)
python -m spec_engine.training.eagle_prompts  # the EAGLE-3 prompt set (data/eagle_prompts.jsonl)
python -m spec_engine.training.eagle_data     # the target's answers and their features, for EAGLE-3
python -m spec_engine.training.train_eagle    # an EAGLE head (EAGLE-1/2 or EAGLE-3 layout)
"""
