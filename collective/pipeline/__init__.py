"""Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B) with data parallelism beside it: `backend.kind = "pipeline"`
(psarch's) and `"torch_pipeline"` (torch.distributed.pipelining, the peer, torch_peer.py). The model is cut along its
units into stages (stage.py), each schedule is data, every rank's instruction list testable without communication
(schedule.py, whose `simulate` counts the bubble), run by engine.py over counted point-to-point transfers (p2p.py);
trainer.py is the backend's Trainer, export.py the consolidated model, spec.py and theory.py its declaration and
predictions. Its benchmark is `psarch bench pipeline`, its study table `psarch report pipeline`. Nothing is imported
here.
"""
