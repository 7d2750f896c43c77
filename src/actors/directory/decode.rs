//! The request directory's decode side: opening a consumer (its generation,
//! sequence and staging grant), publishing and releasing it.

use super::*;

impl RequestDirectory {
    /// [`crate::actors::runtime::Runtime::consumer_open`], after its stateless
    /// checks: `handshake` is built and validated (its notice key drawn)
    /// but for its generation and sequence, which are the directory's to
    /// give; `expected` are the producer ranks it names
    /// (`expected_producers` of them).
    ///
    /// The generation is random ([`Generation::random`]), so it orders
    /// nothing; the sequence does ([`Sequence::next_after`], strictly
    /// increasing over this rank's authorizations), and is used for that
    /// only: a producer takes up a re-authorization of a request ID (a
    /// reused one) in place of the one it holds because its sequence is
    /// greater, whatever order the two handshakes arrive in.
    pub fn consumer_open(
        &mut self,
        mut handshake: Handshake,
        expected: BTreeSet<ProducerRank>,
        producer_tp: u32,
    ) -> Result<Handshake, RuntimeError> {
        let request = handshake.request_id.clone();
        if self.consumers.get(&request).is_some_and(|(_, a)| a.connected()) {
            return Err(RuntimeError::DuplicateRequest(request.0));
        }
        let generation = Generation::random();
        let sequence = Sequence::next_after(self.last_sequence);
        self.last_sequence = sequence;
        (handshake.generation, handshake.sequence) = (generation, sequence);
        let staging = self.grant_staging(&handshake, producer_tp).map(|(grant, arena)| {
            handshake.staging = Some(grant);
            ConsumerStaging {
                grant,
                arena,
                blocks: handshake.block_ids.len() as u32,
                producer_tp,
                layout: self.shared.local.clone(),
            }
        });
        let capability = handshake.capability.clone();
        let machine = ConsumerMachine::new(
            request.clone(),
            generation,
            expected,
            handshake.notice_key.clone(),
        );
        let actor = ConsumerActor::new(
            machine,
            (self.cfg.consumer_timeout, self.cfg.quarantine),
            self.router.clone(),
            self.events.clone(),
            self.shared.stats.clone(),
            staging,
            FenceTargets {
                publisher: self.publisher.clone(),
                capability,
                consumer_rank: self.shared.local.tp_rank,
                targets: Vec::new(),
            },
        );
        // Routed before the handshake leaves the runtime (below), so no
        // notice can arrive before its route exists.
        let addr = actor.start_routed();
        self.consumers.insert(request, (generation, addr));
        Ok(handshake)
    }

    /// A staging grant for `handshake`'s blocks, when this rank stages and
    /// writing its pages directly would take at least `staging_min_ranges`
    /// ranges per layer: one per run of blocks consecutive in memory and
    /// plane ([`page_runs`]: padded blocks are never consecutive), or one
    /// per block and plane when a producer of another TP size writes head
    /// slices, unless each block is a whole group of one producer's source
    /// staging ([`grant_group`]: that producer writes runs of whole blocks
    /// from it). The grant is staged in [`grant_group`]'s order. `None`
    /// when the arena is full (counted; the request is written directly).
    fn grant_staging(&self, handshake: &Handshake, producer_tp: u32) -> Option<(StagingGrant, SharedArena)> {
        let arena = self.staging.as_ref()?;
        let local = &self.shared.local;
        if local.groups() > 1 {
            // Staged orders are by request block of one table: a layout of
            // several groups is written into its pages.
            return None;
        }
        let ids = &handshake.block_ids;
        let planes = local.layers.first().map_or(1, |l| l.planes.len());
        let group = grant_group(local, producer_tp);
        let ranges = if producer_tp != local.tp_size && local.head_major && group == 1 {
            ids.len() * planes
        } else {
            page_runs(local, ids)
        };
        if ranges < self.cfg.staging_min_ranges {
            return None;
        }
        let len = staged_bytes(local, ids.len() as u32)?;
        match arena.lock().alloc(len) {
            Ok(base) => {
                self.shared.stats.staging_granted.inc();
                Some((StagingGrant { base, len, group }, arena.clone()))
            }
            Err(e) => {
                self.shared.stats.staging_exhausted.inc();
                tracing::debug!(error = %e, "no staging grant: writing the pages directly");
                None
            }
        }
    }

    /// Bytes and pieces of staging granted now (decode side).
    pub fn staging_in_use(&self) -> (u64, usize) {
        crate::staging::in_use(self.staging.as_ref())
    }

    /// The consumer actor of `request`'s authorization `generation`.
    pub fn consumer(
        &self,
        request: &RequestId,
        generation: Generation,
    ) -> Result<Addr<ConsumerActor>, RuntimeError> {
        match self.consumers.get(request) {
            Some((g, addr)) if *g == generation => Ok(addr.clone()),
            Some((g, _)) => Err(RuntimeError::StaleGeneration {
                request: request.0.clone(),
                got: generation.0,
                current: g.0,
            }),
            None => Err(RuntimeError::UnknownRequest(request.0.clone())),
        }
    }

    /// The consumer of `request`'s `generation`, told where its handshake
    /// was published (where its fence would go).
    pub fn consumer_published(
        &self,
        request: &RequestId,
        generation: Generation,
        targets: Vec<(String, u32)>,
    ) -> Result<Addr<ConsumerActor>, RuntimeError> {
        let addr = self.consumer(request, generation)?;
        addr.do_send(Published(targets));
        Ok(addr)
    }

    /// [`crate::actors::runtime::Runtime::consumer_release`].
    pub fn consumer_release(&mut self, request: &RequestId) -> Result<(), RuntimeError> {
        let (_, addr) = self
            .consumers
            .remove(request)
            .ok_or_else(|| RuntimeError::UnknownRequest(request.0.clone()))?;
        addr.do_send(ReleaseRequest);
        Ok(())
    }
}
