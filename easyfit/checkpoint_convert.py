"""`easyfit.checkpoint_convert`: the public path of the sharded-checkpoint converter (code: easyfit.saving.convert).

    python -m easyfit.checkpoint_convert checkpoints/epoch4 epoch4.pt
"""
from easyfit.saving.convert import convert_checkpoint, main

__all__ = ["convert_checkpoint"]

if __name__ == "__main__":
    main()
