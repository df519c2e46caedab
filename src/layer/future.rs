use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::body::ResponseBody;
use super::decide::Verdict;
use super::headers::Fields;
use super::rejection::Protocol;
use crate::BucketStore;
use crate::cancel::RefundGuard;
use crate::store::BoxFuture;

pin_project! {
    /// Response future of [`RateLimit`](super::RateLimit): decides, waits if the request
    /// reserved tokens, then runs the inner service's call.
    pub struct ResponseFuture<S, ReqBody, St>
    where
        S: Service<Request<ReqBody>>,
        St: BucketStore,
        St: Clone,
    {
        #[pin]
        state: State<S, ReqBody, St>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody, St>
    where
        S: Service<Request<ReqBody>>,
        St: BucketStore,
        St: Clone,
    {
        Deciding {
            decision: BoxFuture<'static, Verdict<St>>,
            inner: Option<S>,
            req: Option<Request<ReqBody>>,
        },
        // Boxed: only requests that reserved tokens wait, and a timer and a request held inline
        // would make every request's future larger to move around.
        Waiting {
            parked: Pin<Box<Parked<S, ReqBody, St>>>,
        },
        Calling {
            #[pin]
            fut: S::Future,
            ratelimit: Option<Fields>,
        },
        // Answered without a decision (a request no rule could key, refused).
        Answered {
            res: Option<Response<Bytes>>,
        },
        Done,
    }
}

pin_project! {
    /// A request that reserved tokens, until they have refilled.
    struct Parked<S, ReqBody, St>
    where
        St: BucketStore,
        St: Clone,
    {
        #[pin]
        sleep: tokio::time::Sleep,
        guard: Option<RefundGuard<St>>,
        inner: Option<S>,
        req: Option<Request<ReqBody>>,
        ratelimit: Option<Fields>,
    }
}

impl<S, ReqBody, St> ResponseFuture<S, ReqBody, St>
where
    S: Service<Request<ReqBody>>,
    St: BucketStore + Clone,
{
    pub(crate) fn decide(
        decision: BoxFuture<'static, Verdict<St>>,
        inner: S,
        req: Request<ReqBody>,
    ) -> Self {
        Self {
            state: State::Deciding {
                decision,
                inner: Some(inner),
                req: Some(req),
            },
        }
    }

    pub(crate) fn answer(res: Response<Bytes>) -> Self {
        Self {
            state: State::Answered { res: Some(res) },
        }
    }

    pub(crate) fn call(mut inner: S, req: Request<ReqBody>, ratelimit: Option<Fields>) -> Self {
        Self {
            state: State::Calling {
                fut: inner.call(req),
                ratelimit,
            },
        }
    }
}

const POLLED_AFTER_DONE: &str = "burstgate::layer::ResponseFuture polled after completion";

impl<S, ReqBody, St, ResBody> Future for ResponseFuture<S, ReqBody, St>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    St: BucketStore + Clone,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Deciding {
                    decision,
                    inner,
                    req,
                } => {
                    let (wait, guard, ratelimit, info) = match ready!(decision.as_mut().poll(cx)) {
                        Verdict::Admit {
                            wait,
                            guard,
                            ratelimit,
                            info,
                        } => (wait, guard, ratelimit, info),
                        // The request and the inner service are dropped where they are.
                        Verdict::Reject(refusal) => {
                            let Some(req) = req.as_ref() else {
                                panic!("{POLLED_AFTER_DONE}");
                            };
                            let protocol = Protocol::of(req.method(), req.version(), req.headers());
                            let res = refusal.answer(protocol);
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(res.map(ResponseBody::answer)));
                        }
                    };
                    // The info goes into the request where it lies, and the request is taken
                    // out in the branch that uses it: a request is a few hundred bytes, and every
                    // move of it (out of the state, through a tuple, into the call) is a copy.
                    if let Some(info) = info {
                        let Some(req) = req.as_mut() else {
                            panic!("{POLLED_AFTER_DONE}");
                        };
                        req.extensions_mut().insert(info);
                    }
                    let Some(mut inner) = inner.take() else {
                        panic!("{POLLED_AFTER_DONE}");
                    };
                    if wait.is_zero() {
                        if let Some(guard) = guard {
                            guard.disarm();
                        }
                        let Some(req) = req.take() else {
                            panic!("{POLLED_AFTER_DONE}");
                        };
                        let fut = inner.call(req);
                        this.state.set(State::Calling { fut, ratelimit });
                    } else {
                        let Some(req) = req.take() else {
                            panic!("{POLLED_AFTER_DONE}");
                        };
                        let parked = Box::pin(Parked {
                            sleep: tokio::time::sleep(wait),
                            guard,
                            inner: Some(inner),
                            req: Some(req),
                            ratelimit,
                        });
                        this.state.set(State::Waiting { parked });
                    }
                }
                StateProj::Waiting { parked } => {
                    let parked = parked.as_mut().project();
                    ready!(parked.sleep.poll(cx));
                    if let Some(guard) = parked.guard.take() {
                        guard.disarm();
                    }
                    let (Some(mut inner), Some(req)) = (parked.inner.take(), parked.req.take())
                    else {
                        panic!("{POLLED_AFTER_DONE}");
                    };
                    let ratelimit = parked.ratelimit.take();
                    let fut = inner.call(req);
                    this.state.set(State::Calling { fut, ratelimit });
                }
                StateProj::Calling { fut, ratelimit } => {
                    let mut res = ready!(fut.poll(cx))?;
                    if let Some(fields) = ratelimit.take() {
                        fields.insert_into(res.headers_mut());
                    }
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(res.map(ResponseBody::inner)));
                }
                StateProj::Answered { res } => {
                    let Some(res) = res.take() else {
                        panic!("{POLLED_AFTER_DONE}");
                    };
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(res.map(ResponseBody::answer)));
                }
                StateProj::Done => panic!("{POLLED_AFTER_DONE}"),
            }
        }
    }
}
