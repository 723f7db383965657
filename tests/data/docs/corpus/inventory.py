"""Stock control for the Larkfield warehouse."""

import math

SERVICE_FACTOR = 1.65  # z-score for a 95 percent service level


class Warehouse:
    """A warehouse with a fixed number of pallet places."""

    capacity = 12_000  # pallet places

    def __init__(self, name: str):
        self.name = name
        self.stock: dict[str, int] = {}

    def free_places(self) -> int:
        return self.capacity - sum(self.stock.values())


def safety_stock(daily_demand_std: float, lead_time_days: float) -> float:
    """Extra units kept to cover demand swings during the supplier's lead time."""
    return SERVICE_FACTOR * daily_demand_std * math.sqrt(lead_time_days)


def reorder_threshold(daily_demand: float, daily_demand_std: float, lead_time_days: float) -> float:
    """Order more stock when the level falls below expected lead-time demand plus safety stock."""
    return daily_demand * lead_time_days + safety_stock(daily_demand_std, lead_time_days)
