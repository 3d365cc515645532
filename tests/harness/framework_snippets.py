"""Rank-side code that the framework tests share, on one host (tests/cluster/test_frameworks.py)
and across hosts (tests/hosts/test_multihost.py)."""

#: A dataset of random tokens and a tiny GPT-2 built from its config (nothing is downloaded),
#: for the Hugging Face Trainer. Needs ``torch``, ``Dataset``, ``GPT2Config`` and
#: ``GPT2LMHeadModel`` imported; makes ``Tokens`` and ``gpt``.
TINY_GPT = """
class Tokens(Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
gpt = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
"""
