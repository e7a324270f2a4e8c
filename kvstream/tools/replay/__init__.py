"""``kvstream replay``: read the real topics to find out, after the fact, what the routers
knew and why they decided as they did (DESIGN.md §7, §9). Every piece calls the
replica's own fold (kvstream.replica.fold) and the router's own scoring, so a replay
computes exactly what a replica computed."""
