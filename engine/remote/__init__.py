"""The remote tier: READY pool blocks published to a Mooncake Store shared by the engines
of many hosts, and a lookup's prefix continued through the blocks it holds."""
