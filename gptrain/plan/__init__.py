"""``gptrain plan``: predicted step time, tokens/s and memory per GPU for every parallel layout of a
run, from arithmetic over the model's shapes and a calibration table of the GPU (hardware.py),
checked against the rules ``gptrain train`` enforces (search.py calls them)."""
