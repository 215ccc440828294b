"""Integrations map plans onto ecosystems (Hugging Face Transformers: ``hf``).

The core imports none of them: each reaches into one outside library, which stays optional, and
only the command line and users' own code import them.
"""
