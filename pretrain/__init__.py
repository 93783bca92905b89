"""From-scratch pattern pre-training (``deepspeed pretrain.py --config ...``)."""
