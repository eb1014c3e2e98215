"""The compression methods: one file per method, each a Policy (base.py) registered by name in budget.py."""
