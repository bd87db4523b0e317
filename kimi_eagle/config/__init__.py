"""What runs where, before any host is contacted: the inventory, recipes, and the steps a job runs from
the resolved settings (kimi_eagle_host/settings.py declares each setting)."""
