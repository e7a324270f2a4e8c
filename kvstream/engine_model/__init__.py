"""What an inference engine costs and how it is shaped, shared by ``kvstream simulate``
(simulated time) and ``kvstream emulate`` (wall-clock time): one cost model for both
(``costs``: the time of one engine step; ``errors``)."""
