"""What every part of evalkit builds on, without torch: its errors, the budget grammar, how a method declares its
settings, a model's attention shape, content fingerprints, where conf/ and tasks/ are, and the terminal's one voice."""
