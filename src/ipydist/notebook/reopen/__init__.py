"""What a page that opens the notebook again finds: the kernel answers it while a cell runs
(:mod:`busy_shell`), and the cells it missed are kept in the kernel and caught up
(:mod:`kept_cells`, with the labextension's catch-up plugin)."""

from __future__ import annotations


def install(shell) -> None:
    """Both, once per kernel (nothing outside a kernel, or on an ipykernel without a shell
    channel thread: there the page waits for the cell, as before)."""
    from ipydist.notebook.reopen import busy_shell, kept_cells

    kernel = getattr(shell, "kernel", None)
    if kernel is None or getattr(kernel, "_ipydist_reopen", False):
        return
    kernel._ipydist_reopen = True
    keeper = kept_cells.install(shell)
    busy_shell.install(kernel, keeper)
