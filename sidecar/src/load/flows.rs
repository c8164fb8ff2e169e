//! Requests in flight per flow — a tenant within a priority class — for fairness under
//! admission control: a tenant holding less than its fair share of its class's requests in
//! flight may go past the class's saturation limits (see [`crate::admission`]).
//!
//! Counted from bookings (booked → released), so every way a booking ends (its end reported,
//! its replica gone, its age expired) ends its flow's count too.

use std::collections::HashMap;

/// Who a booking is for: a named tenant in a priority class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Flow {
    /// The class, as the admission gate numbers them.
    pub class: usize,
    /// The tenant's name, hashed.
    pub tenant: u64,
}

/// Requests in flight per flow, and per class (requests, flows with any).
#[derive(Debug, Default)]
pub struct Flows {
    flows: HashMap<Flow, u64>,
    classes: HashMap<usize, (u64, u64)>,
}

impl Flows {
    /// A request of `flow` was booked.
    pub fn add(&mut self, flow: Flow) {
        let n = self.flows.entry(flow).or_default();
        *n += 1;
        let class = self.classes.entry(flow.class).or_default();
        class.0 += 1;
        class.1 += u64::from(*n == 1);
    }

    /// A request of `flow` was released.
    pub fn remove(&mut self, flow: Flow) {
        let Some(n) = self.flows.get_mut(&flow) else { return };
        *n -= 1;
        let gone = *n == 0;
        if gone {
            self.flows.remove(&flow);
        }
        if let Some(class) = self.classes.get_mut(&flow.class) {
            class.0 -= 1;
            class.1 -= u64::from(gone);
            if class.0 == 0 {
                self.classes.remove(&flow.class);
            }
        }
    }

    /// Whether `flow` holds less than its fair share of its class's requests in flight: the
    /// class's requests split evenly over its flows in flight, this one counted among them.
    /// A flow of a class with nothing in flight is under its share.
    pub fn under_share(&self, flow: Flow) -> bool {
        let mine = self.flows.get(&flow).copied().unwrap_or(0);
        let (requests, flows) = self.classes.get(&flow.class).copied().unwrap_or_default();
        let flows = flows + u64::from(mine == 0);
        mine * flows < requests.max(1)
    }

    /// Flows with requests in flight.
    pub fn len(&self) -> usize {
        self.flows.len()
    }

    /// Whether no flow has a request in flight.
    pub fn is_empty(&self) -> bool {
        self.flows.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn flow(class: usize, tenant: u64) -> Flow {
        Flow { class, tenant }
    }

    #[test]
    fn a_tenant_below_an_even_split_is_under_its_share() {
        let mut f = Flows::default();
        let (burst, steady, other_class) = (flow(0, 1), flow(0, 2), flow(1, 2));
        assert!(f.under_share(steady), "nothing in flight: under its share");
        for _ in 0..10 {
            f.add(burst);
        }
        assert!(!f.under_share(burst), "alone, it holds all of the class");
        assert!(f.under_share(steady), "a newcomer's share is half of ten");
        for _ in 0..4 {
            f.add(steady);
        }
        assert!(f.under_share(steady), "4 of 14, split over 2");
        for _ in 0..5 {
            f.add(steady);
        }
        assert!(f.under_share(steady), "9 of 19");
        f.add(steady);
        assert!(!f.under_share(steady) && !f.under_share(burst), "10 of 20 each: both at their share");
        assert!(f.under_share(other_class), "another class's flows do not count");
    }

    #[test]
    fn releases_forget_flows_and_classes() {
        let mut f = Flows::default();
        f.add(flow(0, 1));
        f.add(flow(0, 1));
        f.add(flow(0, 2));
        f.remove(flow(0, 1));
        f.remove(flow(0, 1));
        assert_eq!(f.len(), 1);
        assert!(!f.under_share(flow(0, 2)), "alone again");
        f.remove(flow(0, 2));
        f.remove(flow(0, 2));
        assert!(f.is_empty() && f.classes.is_empty());
    }
}
