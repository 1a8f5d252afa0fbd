"""The emulated cluster and virtual devices: where a run's processes live (placement.py: on this machine's
loopback, or each on a node of its own joined by shaped links, emulated.py over netns.py), what a virtual device
computes and when (device.py, pacing.py), stragglers (stragglers.py), time dilation (dilation.py), the step
windows every rank marks (window.py) and the records they report (records.py).

The launcher's one interface to it is `psarch.cluster.placement.place(cfg)`; backends never see it. Nothing is
imported here: importing psarch.cluster.device (a config check does) runs no more than that module.
"""
