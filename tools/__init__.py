"""What proves a bundle before upload, beside the bundle and never shipped in it.

Tools may import the training modules (train, model, config, ...); training never imports a tool.
Run them from the project root: ``python -m tools COMMAND ...`` or ``python -m tools.<module>``.
"""
